"""Mixtral: Mistral's decoder with each block's feed-forward replaced by routed experts.

Besides logits, every forward sets `aux_loss`, the router load-balancing loss averaged over the
blocks, which the trainer adds to the loss (weighted by model.moe_aux_loss_coeff), and adds to
router statistics that `extra_metrics()` hands to the metrics logger.
"""

import torch
from torch import nn

from titanlite.models.llama.model import Transformer, TransformerBlock
from titanlite.models.mistral.model import sliding_window_attention
from titanlite.models.mixtral.args import MixtralArgs
from titanlite.models.mixtral.moe import MoE


class Mixtral(Transformer):
    def __init__(self, args: MixtralArgs):
        super().__init__(args)
        self.aux_loss: torch.Tensor | None = None
        self._forwards = 0  # since the last extra_metrics()
        self._aux_loss_sum: torch.Tensor | None = None
        self._load_sum: torch.Tensor | None = None  # [layers, experts] tokens routed

    def build_block(self, layer_id: int, args: MixtralArgs) -> nn.Module:
        moe = MoE(args.dim, args.ffn_hidden_dim, args.num_experts, args.top_k)
        return TransformerBlock(layer_id, args, attention=sliding_window_attention(args), feed_forward=moe)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        moes = [block.feed_forward for block in self.layers.values()]
        self.aux_loss = torch.stack([moe.aux_loss for moe in moes]).mean()
        aux_loss, load = self.aux_loss.detach(), torch.stack([moe.tokens_per_expert for moe in moes])
        if self._forwards:
            aux_loss, load = aux_loss + self._aux_loss_sum, load + self._load_sum
        self._aux_loss_sum, self._load_sum, self._forwards = aux_loss, load, self._forwards + 1
        return logits

    @torch.no_grad()
    def extra_metrics(self) -> dict[str, torch.Tensor]:
        """Router statistics over the forwards since the last call, as 0-dim tensors:

        moe_aux_loss          the load-balancing loss (1.0 = balanced)
        moe_expert_share/i    expert i's share of the routed tokens, averaged over blocks (1/experts = balanced)
        moe_max_load          the busiest expert's share x experts, in the worst block (1.0 = balanced)
        """
        if not self._forwards:
            return {}
        share = self._load_sum.float() / self._load_sum.sum(dim=-1, keepdim=True)  # [layers, experts]
        metrics = {"moe_aux_loss": self._aux_loss_sum / self._forwards,
                   "moe_max_load": share.max() * self.args.num_experts}
        metrics.update({f"moe_expert_share/{i}": s for i, s in enumerate(share.mean(dim=0))})
        self._forwards = 0
        return metrics

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """As Llama's; active=True counts what one token uses: top_k of the experts in each block."""
        a = self.args
        idle_experts = a.n_layers * (a.num_experts - a.top_k) * 3 * a.dim * a.ffn_hidden_dim
        return super().num_params(exclude_embedding) - (idle_experts if active else 0)
