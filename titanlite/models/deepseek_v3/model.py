"""DeepSeek-V3: Llama's pre-norm decoder with multi-head latent attention in every block, a dense
SwiGLU feed-forward in the first n_dense_layers blocks and routed experts (with shared experts) after.

Multi-token prediction is left out (see args.py).
"""

import torch

from titanlite.models.deepseek_v3.args import DeepSeekV3Args
from titanlite.models.deepseek_v3.attention import MultiHeadLatentAttention
from titanlite.models.deepseek_v3.rope import rope_tables
from titanlite.models.llama.model import FeedForward, Transformer, TransformerBlock


class DeepSeekV3(Transformer):
    def build_block(self, layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args, attention=MultiHeadLatentAttention(args),
                                feed_forward=FeedForward(args.dim, args.ffn_hidden_dim))

    def _rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.args, device=device)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """As Llama's; active=True counts what one token uses: top_k of the routed experts in each MoE block."""
        a = self.args
        moe_blocks = sum(int(layer_id) >= a.n_dense_layers for layer_id in self.layers)
        idle_experts = moe_blocks * (a.num_experts - a.top_k) * 3 * a.dim * a.moe_hidden_dim
        return super().num_params(exclude_embedding) - (idle_experts if active else 0)
