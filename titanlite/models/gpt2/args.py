"""GPT-2's hyper-parameters and the published sizes (flavors)."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPT2Args:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257  # -1 = the tokenizer's vocab, filled in by the trainer
    max_seq_len: int = 1024  # rows of the learned position table: the longest sequence the model reads
    norm_eps: float = 1e-5
    reset_position_ids: bool = False  # positions restart at each document (from model.reset_position_ids)

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must divide by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # plain multi-head attention

    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim

    @property
    def tie_embeddings(self) -> bool:
        return True  # GPT-2's output projection is always its token embedding matrix


_GPT2 = GPT2Args()

GPT2_FLAVORS = {
    "debugmodel": replace(_GPT2, dim=256, n_layers=6, n_heads=8, vocab_size=-1),
    "124M": _GPT2,
    "355M": replace(_GPT2, dim=1024, n_layers=24, n_heads=16),
    "774M": replace(_GPT2, dim=1280, n_layers=36, n_heads=20),
    "1.5B": replace(_GPT2, dim=1600, n_layers=48, n_heads=25),
    # The simple FSDP trainer's "~4B" GPT-2: 2,648,931,840 parameters in truth.
    "2.6B": replace(_GPT2, dim=2560, n_layers=32, n_heads=32),
}
