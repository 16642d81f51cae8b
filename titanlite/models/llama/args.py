"""The Llama architecture's hyper-parameters and the published sizes (flavors)."""

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 long-context RoPE: slow (long-wavelength) frequencies are divided by `factor`,
    fast ones kept, and the band between them blended smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32  # fewer than n_heads = grouped-query attention
    vocab_size: int = -1  # -1 = the tokenizer's vocab, filled in by the trainer
    multiple_of: int = 256  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    intermediate_size: int | None = None  # the FFN hidden size as a config.json gives it; None = derived as Meta does
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # positions the RoPE tables cover; longer sequences are refused
    tie_embeddings: bool = False  # the output projection reuses the token embedding matrix
    reset_position_ids: bool = False  # RoPE positions restart at each document (from model.reset_position_ids)

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must divide by n_heads ({self.n_heads}) and n_heads by n_kv_heads "
                f"({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        # Meta's sizing: 2/3 of 4*dim keeps SwiGLU's three matrices at the cost of a 4*dim MLP,
        # then the optional multiplier, then round up for hardware-friendly shapes.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


_LLAMA3 = ModelArgs(vocab_size=128256, rope_theta=500000.0, max_seq_len=131072, n_kv_heads=8)
_LLAMA3_1_ROPE = RopeScaling(factor=8.0)
_LLAMA3_2_ROPE = RopeScaling(factor=32.0)  # the 3.2 1B/3B checkpoints were trained with 32, not 3.1's 8

LLAMA3_FLAVORS = {
    # n_kv_heads 8 < 16 heads so the CPU debug runs exercise the grouped-query path too; 8192 positions
    # for the long-window context-parallel runs (docs/benchmarks.md).
    "debugmodel": replace(_LLAMA3, dim=256, n_layers=6, n_heads=16, vocab_size=-1, max_seq_len=8192),
    "1B": replace(
        _LLAMA3,
        dim=2048,
        n_layers=16,
        n_heads=32,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA3_2_ROPE,
        tie_embeddings=True,
    ),
    "3B": replace(
        _LLAMA3,
        dim=3072,
        n_layers=28,
        n_heads=24,
        ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA3_2_ROPE,
        tie_embeddings=True,
    ),
    "8B": replace(
        _LLAMA3,
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=_LLAMA3_1_ROPE,
    ),
    "70B": replace(
        _LLAMA3,
        dim=8192,
        n_layers=80,
        n_heads=64,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=_LLAMA3_1_ROPE,
    ),
    "405B": replace(
        _LLAMA3,
        dim=16384,
        n_layers=126,
        n_heads=128,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=_LLAMA3_1_ROPE,
    ),
}

_LLAMA2 = ModelArgs(vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096)

LLAMA2_FLAVORS = {
    "debugmodel": replace(_LLAMA2, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=-1),
    "7B": replace(_LLAMA2, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32),
    "13B": replace(_LLAMA2, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40),
    "70B": replace(_LLAMA2, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
}
