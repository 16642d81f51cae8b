"""DeepSeek-V3's hyper-parameters and the published sizes (flavors).

Names follow DeepSeek's reference code; the Hugging Face config.json key of each is in its comment.
The multi-token-prediction depths (config.json num_nextn_predict_layers; mtp.py) are off in every flavor
unless model.mtp_layers asks for them (DeepSeek-V3 671B trained with 1).
"""

from dataclasses import dataclass, replace

from titanlite.errors import UserError


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (arXiv 2309.00071) as DeepSeek configures it (config.json rope_scaling, type "yarn"): the
    slow RoPE frequencies are divided by `factor`, the fast ones kept, a linear ramp between the
    dimensions that turn beta_slow and beta_fast times over original_max_seq_len positions."""

    factor: float = 40.0
    original_max_seq_len: int = 4096  # original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # scales cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 1.0  # scales the softmax by mscale(factor, mscale_all_dim) ** 2


@dataclass(frozen=True)
class DeepSeekV3Args:
    dim: int = 7168  # hidden_size
    n_layers: int = 61  # num_hidden_layers
    n_heads: int = 128  # num_attention_heads
    vocab_size: int = 129280  # -1 = the tokenizer's vocab, filled in by the trainer
    ffn_hidden_dim: int = 18432  # intermediate_size: the SwiGLU of the first n_dense_layers blocks
    n_dense_layers: int = 3  # first_k_dense_replace: blocks with a dense feed-forward before the MoE ones
    # Multi-head latent attention
    q_lora_rank: int = 1536  # the query's low rank; 0 (config.json null) projects it directly
    kv_lora_rank: int = 512  # the compressed key/value latent
    qk_nope_head_dim: int = 128  # per head, the query/key part without RoPE
    qk_rope_head_dim: int = 64  # per head, the decoupled RoPE part (the key's is shared by all heads)
    v_head_dim: int = 128
    # Mixture of experts
    num_experts: int = 256  # n_routed_experts
    num_shared_experts: int = 1  # n_shared_experts: one SwiGLU of num_shared_experts x moe_hidden_dim
    top_k: int = 8  # num_experts_per_tok
    moe_hidden_dim: int = 2048  # moe_intermediate_size
    n_group: int = 8  # experts fall into n_group groups; a token picks among its best topk_group groups
    topk_group: int = 4
    routed_scaling_factor: float = 2.5  # multiplies the routed experts' (normalised) weights
    norm_eps: float = 1e-6  # rms_norm_eps (the q and kv latent norms keep 1e-6, as in DeepSeek's code)
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_seq_len: int = 4096  # positions the RoPE tables cover; longer sequences are refused
    tie_embeddings: bool = False  # the output projection reuses the token embedding matrix
    reset_position_ids: bool = False  # RoPE positions restart at each document (from model.reset_position_ids)
    mtp_layers: int = 0  # num_nextn_predict_layers: multi-token prediction depths (from model.mtp_layers)
    mtp_loss_weight: float = (
        0.3  # the MTP loss's weight in the training loss, the paper's lambda (model.mtp_loss_weight)
    )

    def __post_init__(self):
        """Shapes that cannot build a model are refused with one sentence, naming the args' config.json keys."""
        problem = first_problem(self)
        if problem:
            raise UserError(f"this DeepSeek-V3 model cannot be built: {problem}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_kv_heads(self) -> int:
        """Every query head has its own key and value (expanded from the shared latent)."""
        return self.n_heads


def first_problem(a: DeepSeekV3Args) -> str | None:
    """The first inconsistent shape of `a`, as a phrase with its fix; None when the model can be built."""
    if not 0 <= a.q_lora_rank < a.dim or not 0 < a.kv_lora_rank < a.dim:
        return (
            f"the MLA ranks q_lora_rank {a.q_lora_rank} and kv_lora_rank {a.kv_lora_rank} must be low ranks of "
            f"dim (hidden_size) {a.dim}: set q_lora_rank to 0 (no query compression) or between 1 and {a.dim - 1}, "
            f"and kv_lora_rank between 1 and {a.dim - 1}"
        )
    if a.qk_rope_head_dim <= 0 or a.qk_rope_head_dim % 2 or a.qk_nope_head_dim < 0 or a.v_head_dim <= 0:
        return (
            f"the MLA head sizes qk_rope_head_dim {a.qk_rope_head_dim}, qk_nope_head_dim {a.qk_nope_head_dim} and "
            f"v_head_dim {a.v_head_dim} must be an even positive number (RoPE rotates pairs), at least 0 and positive"
        )
    if not 1 <= a.top_k <= a.num_experts:
        return (
            f"top_k (num_experts_per_tok) {a.top_k} must be between 1 and num_experts (n_routed_experts) "
            f"{a.num_experts}; lower top_k or add experts"
        )
    if a.n_group < 1 or a.num_experts % a.n_group:
        return f"n_group {a.n_group} must divide num_experts (n_routed_experts) {a.num_experts}; choose a divisor"
    if not 1 <= a.topk_group <= a.n_group:
        return f"topk_group {a.topk_group} must be between 1 and n_group {a.n_group}; lower topk_group"
    reachable = a.topk_group * (a.num_experts // a.n_group)
    if a.top_k > reachable:
        return (
            f"top_k (num_experts_per_tok) {a.top_k} exceeds the {reachable} experts of the topk_group "
            f"{a.topk_group} groups a token may use; raise topk_group or lower top_k"
        )
    if a.n_dense_layers < 0:
        return f"n_dense_layers (first_k_dense_replace) {a.n_dense_layers} must be 0 or more"
    return None


# DeepSeek-V3 (arXiv 2412.19437), huggingface.co/deepseek-ai/DeepSeek-V3 config.json; its MTP layer only with
# model.mtp_layers 1.
_V3 = DeepSeekV3Args(rope_scaling=YarnScaling(), max_seq_len=163840)

DEEPSEEK_V3_FLAVORS = {
    # Tiny, for CPU runs: low-rank q, group-limited routing (4 groups of 2 experts, the best 2 groups).
    "debugmodel": replace(
        _V3,
        dim=256,
        n_layers=4,
        n_heads=8,
        vocab_size=-1,
        ffn_hidden_dim=512,
        n_dense_layers=1,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        n_group=4,
        topk_group=2,
        rope_scaling=None,
        max_seq_len=2048,
    ),
    # Moonlight-16B-A3B (DeepSeek-V3's architecture at V2-Lite's size), huggingface.co/moonshotai/Moonlight-16B-A3B
    # config.json: 27 layers, 64 routed experts + 2 shared, top-6 in one group, q projected directly, no YaRN.
    "16B": replace(
        _V3,
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        ffn_hidden_dim=11264,
        n_dense_layers=1,
        q_lora_rank=0,
        num_experts=64,
        num_shared_experts=2,
        top_k=6,
        moe_hidden_dim=1408,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=None,
        max_seq_len=8192,
    ),
    "671B": _V3,
}
