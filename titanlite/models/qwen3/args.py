"""Qwen3's hyper-parameters: Llama's, with head_dim and the FFN size given rather than derived,
and Qwen3 MoE's experts.

Shapes from the published config.json of each Qwen/Qwen3-* checkpoint (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim 128, intermediate_size, tie_word_embeddings;
rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936, max_position_embeddings 40960), as copied into
fine-tunes' configs, e.g. huggingface.co/MultiRL/qwen3_4b_instruct_sft (4B) and tilman-d/model (14B)
config.json, and for the MoE models MindSpeed-RL's configs/model/qwen3_30b_a3b.yaml and
qwen3_235b_a22b.yaml (128 experts, top-8, moe_ffn_hidden_size 768 / 1536, 4 kv heads, untied). The
totals these give equal the published parameter counts (tests/test_qwen3.py).
"""

from dataclasses import dataclass

from titanlite.models.llama.args import ModelArgs


@dataclass(frozen=True)
class Qwen3Args(ModelArgs):
    head_dim: int = 128  # independent of dim // n_heads (Llama's property, replaced by this field)
    intermediate_size: int = 3072  # the SwiGLU hidden size, as published
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    vocab_size: int = 151936
    max_seq_len: int = 40960

    @property
    def ffn_hidden_dim(self) -> int:
        return self.intermediate_size


@dataclass(frozen=True)
class Qwen3MoeArgs(Qwen3Args):
    num_experts: int = 128  # SwiGLU experts per block (every block is sparse in the published models)
    top_k: int = 8  # experts each token is sent to
    moe_intermediate_size: int = 768  # each expert's hidden size
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")

    @property
    def ffn_hidden_dim(self) -> int:
        return self.moe_intermediate_size


_DENSE_DEBUG = dict(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=-1, max_seq_len=2048)
QWEN3_FLAVORS = {
    "debugmodel": Qwen3Args(**_DENSE_DEBUG, intermediate_size=768),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, intermediate_size=3072, tie_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, intermediate_size=6144, tie_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, intermediate_size=9728, tie_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, intermediate_size=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, intermediate_size=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, intermediate_size=25600),
}

QWEN3_MOE_FLAVORS = {
    "debugmodel": Qwen3MoeArgs(**_DENSE_DEBUG, num_experts=8, top_k=2, moe_intermediate_size=256),
    # intermediate_size: config.json's dense MLP size, unused (every block is sparse) but part of the published shapes.
    "30B-A3B": Qwen3MoeArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
    ),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=1536,
        intermediate_size=12288,
    ),
}
