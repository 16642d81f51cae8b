"""Mixtral's hyper-parameters: Mistral's, with the feed-forward split into routed experts."""

from dataclasses import dataclass

from titanlite.models.mistral.args import MistralArgs


@dataclass(frozen=True)
class MixtralArgs(MistralArgs):
    num_experts: int = 8  # SwiGLU experts per block, each of Llama's FFN shape (ffn_hidden_dim)
    top_k: int = 2  # experts each token is sent to

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")


MIXTRAL_FLAVORS = {
    "debugmodel": MixtralArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=-1, max_seq_len=2048, rope_theta=1000000.0
    ),
    # FFN 14336 per expert (= 1.3 x 8/3 x 4096 rounded up to 1024); no sliding window in v0.1.
    "8x7B": MixtralArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        vocab_size=32000,
        rope_theta=1000000.0,
        max_seq_len=32768,
    ),
}
