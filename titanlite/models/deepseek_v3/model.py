"""DeepSeek-V3: Llama's pre-norm decoder with multi-head latent attention in every block, a dense
SwiGLU feed-forward in the first n_dense_layers blocks and routed experts with shared experts after
(models/moe.py's SigmoidGroupMoE: sigmoid scores, group-limited top-k, the aux-loss-free bias).

Mixtral's decoder keeps the balance loss and the router statistics; here only the MoE blocks have
them. Each training forward also adds every MoE block's tokens per expert to the step's count,
which the trainer turns into the routing biases' update after the optimizer step (step.py).
With args.mtp_layers, multi-token prediction depths follow the main blocks (mtp.py).
"""

import torch

from titanlite.models.attention import Mask, for_layer
from titanlite.models.deepseek_v3.args import DeepSeekV3Args
from titanlite.models.deepseek_v3.attention import MultiHeadLatentAttention
from titanlite.models.deepseek_v3.mtp import MultiTokenPrediction
from titanlite.models.deepseek_v3.rope import rope_tables
from titanlite.models.llama.model import FeedForward, TransformerBlock
from titanlite.models.mixtral.model import Mixtral, MixtralBlock
from titanlite.models.moe import SigmoidGroupMoE


class DeepSeekV3(MultiTokenPrediction, Mixtral):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self._step_loads: list[dict[str, torch.Tensor]] = []  # per training forward: MoE block id -> tokens per expert
        self.build_mtp(args)

    def build_block(self, layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
        attention = MultiHeadLatentAttention(args)
        if layer_id < args.n_dense_layers:
            return TransformerBlock(
                layer_id, args, attention=attention, feed_forward=FeedForward(args.dim, args.ffn_hidden_dim)
            )
        moe = SigmoidGroupMoE(
            args.dim,
            args.moe_hidden_dim,
            args.num_experts,
            args.top_k,
            n_group=args.n_group,
            topk_group=args.topk_group,
            routed_scaling_factor=args.routed_scaling_factor,
            shared_hidden_dim=args.num_shared_experts * args.moe_hidden_dim,
        )
        return MixtralBlock(layer_id, args, attention=attention, moe=moe)

    def _rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.args, device=device)

    def is_moe(self, layer_id: str) -> bool:
        """By position, not type: AC and compile wrap the blocks."""
        return int(layer_id) >= self.args.n_dense_layers

    def moe_blocks(self) -> int:
        """The MoE blocks of the whole model (a pipeline stage holds some of them)."""
        return max(0, self.args.n_layers - self.args.n_dense_layers)

    def run_blocks(
        self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h, losses = self.run_main_blocks(h, rope_cos, rope_sin, mask)
        mtp = self.weighted_mtp_loss(h, rope_cos, rope_sin, mask)
        return h, losses if mtp is None else {**losses, "mtp": mtp}

    def run_main_blocks(
        self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        aux_losses, loads = [], {}
        for layer_id, block in self.layers.items():
            if self.is_moe(layer_id):
                h, aux_loss, loads[layer_id] = block(h, rope_cos, rope_sin, for_layer(mask, layer_id))
                aux_losses.append(aux_loss)
            else:
                h = block(h, rope_cos, rope_sin, for_layer(mask, layer_id))
        if not aux_losses:  # a pipeline stage of dense blocks only
            return h, {}
        # The mean over the model's MoE blocks. pp.py weighs a stage's aux_loss by the stage's share of
        # all blocks (len(layers) / n_layers), so a stage's sum is scaled by the inverse of that share.
        aux_loss = torch.stack(aux_losses).sum() / self.moe_blocks() * (self.args.n_layers / len(self.layers))
        self.record_routing(aux_loss, torch.stack(list(loads.values())))
        if self.training:
            self._step_loads.append(loads)
        return h, {"moe_aux": aux_loss}

    def take_step_loads(self, forwards: int) -> dict[str, torch.Tensor]:
        """Tokens per expert [E] of each MoE block over the step's last `forwards` training forwards,
        and forget them all. Only the last: a pipeline's first step (and its first after validation)
        also runs each stage once on stand-in inputs to infer shapes (torch.distributed.pipelining's
        metadata inference), before the step's own forwards."""
        own, self._step_loads = self._step_loads[-forwards:] if forwards else [], []
        return {layer_id: sum(loads[layer_id] for loads in own) for layer_id in (own[0] if own else {})}

    def balance_experts(self, loads: torch.Tensor, rate: float) -> None:
        """Move each of this model's MoE routers' biases by `rate` toward balance; loads [n_layers, E]
        holds every block's tokens per expert over the step's global batch (step.py sums them)."""
        for layer_id, block in self.layers.items():
            if self.is_moe(layer_id):
                block.feed_forward.balance_experts(loads[int(layer_id)], rate)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """As Llama's; active=True counts what one token uses: top_k of the routed experts in each MoE block."""
        a = self.args
        moe_blocks = sum(map(self.is_moe, self.layers)) + len(self.mtp or ())  # the MTP blocks are MoE ones
        idle_experts = moe_blocks * (a.num_experts - a.top_k) * 3 * a.dim * a.moe_hidden_dim
        return super().num_params(exclude_embedding) - (idle_experts if active else 0)
