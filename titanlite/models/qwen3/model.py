"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE, and head_dim
set apart from dim; Qwen3 MoE puts the shared routed experts (models/moe.py) in every block."""

import torch
import torch.nn as nn

from titanlite.models.llama.model import Attention, Transformer, TransformerBlock
from titanlite.models.mixtral.model import Mixtral, MixtralBlock
from titanlite.models.moe import MoE
from titanlite.models.qwen3.args import Qwen3Args, Qwen3MoeArgs


class Qwen3Attention(Attention):
    """Llama's attention; q and k are RMS-normalised per head (one weight of head_dim shared by all heads)."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, head_dim=args.head_dim)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def normalize_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        super().init_weights(prefix, seed, out_std)
        nn.init.ones_(self.q_norm.weight)
        nn.init.ones_(self.k_norm.weight)


class Qwen3(Transformer):
    def build_block(self, layer_id: int, args: Qwen3Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args, attention=Qwen3Attention(args))


class Qwen3Moe(Mixtral):
    """Mixtral's decoder (balance loss, router metrics, active parameters) with Qwen3's attention and
    router: a softmax over all experts, then the top-k, renormalised where norm_topk_prob."""

    def build_block(self, layer_id: int, args: Qwen3MoeArgs) -> MixtralBlock:
        moe = MoE(
            args.dim,
            args.moe_intermediate_size,
            args.num_experts,
            args.top_k,
            router="softmax_then_topk",
            norm_topk_prob=args.norm_topk_prob,
        )
        return MixtralBlock(layer_id, args, attention=Qwen3Attention(args), moe=moe)
