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
