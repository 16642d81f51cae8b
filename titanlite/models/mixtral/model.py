"""Mixtral: Mistral's decoder with each block's feed-forward replaced by routed experts.

Besides logits, a forward asked for its extra losses returns `moe_aux`, the router load-balancing loss averaged
over the blocks, which the trainer adds to the loss (weighted by model.moe_aux_loss_coeff); every training forward
also adds to router statistics that `extra_metrics()` hands to the metrics logger.
"""

import torch
import torch.nn as nn

from titanlite.models.attention import Mask, for_layer
from titanlite.models.llama.model import Transformer, TransformerBlock
from titanlite.models.mixtral.args import MixtralArgs
from titanlite.models.moe import MoE


class MixtralBlock(TransformerBlock):
    """Llama's pre-norm block around the experts; returns (h, balance loss, tokens per expert)."""

    def __init__(self, layer_id: int, args: MixtralArgs, attention: nn.Module | None = None, moe: MoE | None = None):
        """`attention` and `moe` default to Mixtral's; Qwen3 MoE passes its own."""
        moe = moe if moe is not None else MoE(args.dim, args.ffn_hidden_dim, args.num_experts, args.top_k)
        super().__init__(layer_id, args, attention=attention, feed_forward=moe)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask):
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, mask)
        out, aux_loss, tokens_per_expert = self.feed_forward(self.ffn_norm(h))
        return h + out, aux_loss, tokens_per_expert


class Mixtral(Transformer):
    def __init__(self, args: MixtralArgs):
        super().__init__(args)
        self._forwards = 0  # since the last extra_metrics()
        self._aux_loss_sum: torch.Tensor | None = None
        self._load_sum: torch.Tensor | None = None  # [layers, experts] tokens routed

    def build_block(self, layer_id: int, args: MixtralArgs) -> MixtralBlock:
        return MixtralBlock(layer_id, args)

    def run_blocks(
        self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        aux_losses, loads = [], []
        for name, block in self.layers.items():
            h, aux_loss, load = block(h, rope_cos, rope_sin, for_layer(mask, name))
            aux_losses.append(aux_loss)
            loads.append(load)
        aux_loss = torch.stack(aux_losses).mean()
        self.record_routing(aux_loss, torch.stack(loads))
        return h, {"moe_aux": aux_loss}

    def record_routing(self, aux_loss: torch.Tensor, loads: torch.Tensor) -> None:
        """Add one forward's balance loss and tokens per expert [MoE blocks, experts] to the statistics
        extra_metrics() reads. Called outside the blocks (the root module is neither checkpointed nor
        compiled), where side effects are fine."""
        if not self.training:  # validation forwards stay out of the training statistics
            return
        aux_loss = aux_loss.detach()
        if self._forwards:
            aux_loss, loads = aux_loss + self._aux_loss_sum, loads + self._load_sum
        self._aux_loss_sum, self._load_sum, self._forwards = aux_loss, loads, self._forwards + 1

    @torch.no_grad()
    def extra_metrics(self) -> dict[str, torch.Tensor]:
        """Router statistics over the training-mode forwards since the last call, as 0-dim tensors:

        moe/balance_loss      the load-balancing loss (1.0 = balanced)
        moe/expert_share/i    expert i's share of the routed tokens, averaged over blocks (1/experts = balanced)
        moe/max_load          the busiest expert's share x experts, in the worst block (1.0 = balanced)
        """
        if not self._forwards:
            return {}
        share = self._load_sum.float() / self._load_sum.sum(dim=-1, keepdim=True)  # [layers, experts]
        metrics = {
            "moe/balance_loss": self._aux_loss_sum / self._forwards,
            "moe/max_load": share.max() * self.args.num_experts,
        }
        metrics.update({f"moe/expert_share/{i}": s for i, s in enumerate(share.mean(dim=0))})
        self._forwards = 0
        return metrics

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """As Llama's; active=True counts what one token uses: top_k of the experts in each block."""
        a = self.args
        idle_experts = a.n_layers * (a.num_experts - a.top_k) * 3 * a.dim * a.ffn_hidden_dim
        return super().num_params(exclude_embedding) - (idle_experts if active else 0)
