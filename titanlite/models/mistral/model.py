"""Mistral: the Llama decoder (same blocks, same parameter names) with sliding-window attention."""

from torch import nn

from titanlite.models.llama.model import Attention, Transformer, TransformerBlock
from titanlite.models.mistral.args import MistralArgs


def sliding_window_attention(args: MistralArgs) -> Attention:
    return Attention(args.dim, args.n_heads, args.n_kv_heads, sliding_window=args.sliding_window)


class Mistral(Transformer):
    def build_block(self, layer_id: int, args: MistralArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, attention=sliding_window_attention(args))
