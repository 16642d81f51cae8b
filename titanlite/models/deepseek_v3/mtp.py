"""DeepSeek-V3's multi-token prediction (MTP), arXiv 2412.19437 section 2.2.

Depth k (1..mtp_layers) predicts the token k + 1 places ahead. From the previous depth's hidden states
h^{k-1} (h^0: the main decoder's last block's output, before the final norm) and the embedding of the
token k places ahead, with the model's own (shared) embedding:

    h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      (eh_proj; enorm, hnorm)
    h^k  = TRM_k(h')                                           (one DeepSeek-V3 block, MoE)
    P^k  = OutHead(RMSNorm(h^k))                               (the model's output layer; its own norm)

The concatenation puts the embedding first: the order of the published weights (eh_proj's input
columns, as vLLM's DeepSeek MTP reads them), where the paper's equation writes h first. The loss is
the cross-entropy of depth k against t_{i+k+1}, averaged over the depths; the trainer adds it times
model.mtp_loss_weight (the paper's lambda) to the main loss.

Every depth runs on the whole window, with the tokens shifted by k (torch.roll): the last k positions
see wrapped-around tokens, but attention is causal, so they reach no earlier position, and the loss
leaves them out, with the last label, which lies beyond the window: depth k trains on T - k - 1
positions of a T-token window. So the main decoder's attention mask and RoPE tables serve every depth.
Only the labels the window itself holds are used, which is why MTP trains on text data (every token
trained), one window per rank (no context or pipeline parallelism).

The MTP blocks' routers are not balanced (their aux loss and routing biases stay out of the trainer's
balancing): DeepSeek-V3 drops the MTP module at inference; the routing of its main blocks is unchanged.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import trunc_normal_

BASE_INIT_STD = 0.02


class MTPLayer(nn.Module):
    """One depth: its norms and projection, its block (built by the model, so it is the model's block type),
    the norm before the shared output layer (HF: shared_head.norm)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope_cos, rope_sin, mask) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        out = self.block(h, rope_cos, rope_sin, mask)
        return out[0] if isinstance(out, tuple) else out  # an MoE block also returns its routing statistics

    @torch.no_grad()
    def init_weights(self, prefix: str, seed: int) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            nn.init.ones_(norm.weight)
        trunc_normal_(self.eh_proj.weight, BASE_INIT_STD, key=f"{prefix}eh_proj.weight", seed=seed)
        self.block.init_weights(f"{prefix}block.", seed)


def mtp_loss(
    layers: nn.ModuleDict,
    h: torch.Tensor,
    tokens: torch.Tensor,
    embedding: nn.Module,
    output: nn.Module,
    rope_cos,
    rope_sin,
    mask,
) -> torch.Tensor:
    """The mean over the depths of each depth's mean cross-entropy (fp32), as in the module doc."""
    seq_len = tokens.shape[1]
    losses = []
    for depth, layer in enumerate(layers.values(), start=1):
        h = layer(h, embedding(torch.roll(tokens, -depth, dims=1)), rope_cos, rope_sin, mask)
        logits = output(layer.norm(h[:, : seq_len - depth - 1]))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, depth + 1 :].flatten()))
    return torch.stack(losses).mean()


class MultiTokenPrediction:
    """Mixed into DeepSeekV3 (before its decoder base): the MTP layers as model.mtp (FQNs mtp.<k>.*), their loss
    after the main blocks in training forwards (the forward's extra loss "mtp", weighted by args.mtp_loss_weight,
    which the trainer adds to the loss), and its unweighted mean as loss/mtp in the logged metrics."""

    def build_mtp(self, args) -> None:
        layers = {
            str(k): MTPLayer(args.dim, args.norm_eps, self.build_block(args.n_layers + k, args))
            for k in range(args.mtp_layers)
        }
        self.mtp = nn.ModuleDict(layers) if layers else None
        self._mtp_sum, self._mtp_forwards = None, 0

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._tokens = tokens  # the depths embed the window's later tokens
        return super().forward(tokens, *args, **kwargs)

    def weighted_mtp_loss(self, h: torch.Tensor, rope_cos, rope_sin, mask) -> torch.Tensor | None:
        """Called with the main blocks' output: the depths' loss times args.mtp_loss_weight; None in validation and
        generation forwards (eval mode), which skip the depths, and without depths."""
        if self.mtp is None or not self.training:
            return None
        loss = mtp_loss(self.mtp, h, self._tokens, self.tok_embeddings, self.output, rope_cos, rope_sin, mask)
        self._mtp_sum = loss.detach() + (self._mtp_sum if self._mtp_forwards else 0)
        self._mtp_forwards += 1
        return self.args.mtp_loss_weight * loss

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        super().init_weights(seed)
        for depth, layer in (self.mtp or {}).items():
            layer.init_weights(f"mtp.{depth}.", seed)

    @torch.no_grad()
    def extra_metrics(self) -> dict[str, torch.Tensor]:
        """loss/mtp: the MTP loss (unweighted, the mean over depths) over the training forwards since the last call."""
        metrics = super().extra_metrics()
        if self._mtp_forwards:
            metrics["loss/mtp"] = self._mtp_sum / self._mtp_forwards
            self._mtp_forwards = 0
        return metrics
