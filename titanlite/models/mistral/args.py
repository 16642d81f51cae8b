"""Mistral's hyper-parameters: Llama's, plus a sliding attention window."""

from dataclasses import dataclass, replace

from titanlite.models.llama.args import ModelArgs


@dataclass(frozen=True)
class MistralArgs(ModelArgs):
    # Each token attends to at most this many most recent tokens, itself included; None = all earlier ones.
    sliding_window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or None; got {self.sliding_window}")


# The 7B shapes: dim 4096, 32 layers, 8 key/value heads, FFN 14336 (= 1.3 x 8/3 x 4096 rounded up to 1024).
_MISTRAL_7B = MistralArgs(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim_multiplier=1.3,
    multiple_of=1024,
    norm_eps=1e-5,
    max_seq_len=32768,
)

MISTRAL_FLAVORS = {
    # A window shorter than the debug sequences, so CPU runs and tests go through the masked path.
    "debugmodel": MistralArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=-1, max_seq_len=2048, sliding_window=32
    ),
    "7B": replace(_MISTRAL_7B, vocab_size=32000, rope_theta=10000.0, sliding_window=4096),  # Mistral 7B v0.1
    "mathstral-7B": replace(_MISTRAL_7B, vocab_size=32768, rope_theta=1000000.0, sliding_window=None),
}
