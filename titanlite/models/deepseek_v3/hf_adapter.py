"""DeepSeek-V3 <-> Hugging Face DeepseekV3ForCausalLM (the layout of deepseek-ai/DeepSeek-V3 and
moonshotai/Moonlight-16B-A3B on the Hub, and of transformers' save_pretrained).

One to one, no permutation: DeepSeek stores RoPE dimensions as adjacent pairs, titanlite's layout
(config.json rope_interleave true; transformers rotates them the same way). The tensors of the
multi-token-prediction layer (model.layers.<num_hidden_layers>.*) are never read. The MoE blocks'
router is mlp.gate (its aux-loss-free bias mlp.gate.e_score_correction_bias), the shared experts one
SwiGLU mlp.shared_experts, the routed experts mlp.experts.E.*, stacked as Mixtral's (models/moe_hf.py).
"""

from titanlite.errors import UserError
from titanlite.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from titanlite.models.hf import HFAdapter, required, rope_parameters
from titanlite.models.moe_hf import StackedExpertsHFAdapter

_LAYER = "model.layers.{}."
_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_DENSE = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # SwiGLU: w2(silu(w1 x) * w3 x)

# config.json keys beyond the shapes that change what the model computes: a folder must agree on them.
_BEHAVIOUR_KEYS = ("n_group", "topk_group", "num_experts_per_tok", "routed_scaling_factor", "norm_topk_prob",
                   "scoring_func", "rope_theta", "rope_scaling", "rope_interleave", "rms_norm_eps", "tie_word_embeddings")


class DeepSeekV3HFAdapter(StackedExpertsHFAdapter, HFAdapter):
    architectures = ["DeepseekV3ForCausalLM"]
    model_type = "deepseek_v3"
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention_norm.weight": _LAYER + "input_layernorm.weight",
        "layers.{}.ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
        **{f"layers.{{}}.{ours}": _LAYER + theirs for ours, theirs in _ATTENTION.items()},
        **{f"layers.{{}}.feed_forward.{ours}.weight": _LAYER + f"mlp.{theirs}.weight" for ours, theirs in _DENSE.items()},
        "layers.{}.feed_forward.gate.weight": _LAYER + "mlp.gate.weight",
        "layers.{}.feed_forward.expert_bias": _LAYER + "mlp.gate.e_score_correction_bias",
        **{f"layers.{{}}.feed_forward.shared_experts.{ours}.weight": _LAYER + f"mlp.shared_experts.{theirs}.weight"
           for ours, theirs in _DENSE.items()},
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    ignored = (r"\.rotary_emb\.inv_freq$",)
    expert_name = _LAYER.replace("{}", "{layer}") + "mlp.experts.{expert}.{projection}.weight"
    expert_projections = _DENSE
    shape_keys = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace")
    free_keys = ("num_nextn_predict_layers",)  # the multi-token-prediction layer is never read

    def hf_config(self, args, dtype: str = "float32") -> dict:
        yarn = args.rope_scaling
        return {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "moe_intermediate_size": args.moe_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "n_routed_experts": args.num_experts,
            "n_shared_experts": args.num_shared_experts,
            "num_experts_per_tok": args.top_k,
            "n_group": args.n_group,
            "topk_group": args.topk_group,
            "routed_scaling_factor": args.routed_scaling_factor,
            "first_k_dense_replace": args.n_dense_layers,
            "moe_layer_freq": 1,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None if yarn is None else {
                "type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_max_seq_len,
                "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
                "mscale_all_dim": yarn.mscale_all_dim,
            },
            "rope_interleave": True,
            "tie_word_embeddings": args.tie_embeddings,
            "attention_bias": False,
            "torch_dtype": dtype,
        }

    def args_from_hf_config(self, config: dict):
        """Absent keys take transformers' DeepseekV3Config defaults."""
        rope = rope_parameters(config)
        if rope["rope_type"] not in ("default", "yarn"):
            raise UserError(f"its config.json has rope_type {rope['rope_type']}, which titanlite's DeepSeek-V3 does not "
                            "compute (it knows default and yarn)")
        yarn = None if rope["rope_type"] == "default" else YarnScaling(
            factor=float(rope["factor"]), original_max_seq_len=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)),
            mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 1.0)))
        shapes = {ours: required(config, key) for ours, key in (
            ("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
            ("vocab_size", "vocab_size"), ("ffn_hidden_dim", "intermediate_size"), ("kv_lora_rank", "kv_lora_rank"),
            ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"),
            ("num_experts", "n_routed_experts"), ("moe_hidden_dim", "moe_intermediate_size"))}
        return DeepSeekV3Args(
            **shapes, q_lora_rank=config.get("q_lora_rank") or 0, n_dense_layers=config.get("first_k_dense_replace", 3),
            num_shared_experts=config.get("n_shared_experts", 1), top_k=config.get("num_experts_per_tok", 8),
            n_group=config.get("n_group", 8), topk_group=config.get("topk_group", 4),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)), norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]), rope_scaling=yarn, max_seq_len=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)))

    def config_mismatch(self, config: dict, args) -> str | None:
        """As the shapes, the routing and RoPE settings must agree (absent keys take transformers'
        defaults, which are DeepSeek-V3's)."""
        mismatch = super().config_mismatch(config, args)
        if mismatch:
            return mismatch
        expected = self.hf_config(args)
        for key in _BEHAVIOUR_KEYS:
            if key in config and config[key] != expected[key] and not _same_rope_scaling(key, config[key], expected[key]):
                return f"its config.json has {key} {config[key]} where this model has {expected[key]}"
        return None


def _same_rope_scaling(key: str, theirs, ours) -> bool:
    """rope_scaling dicts agree when their YaRN numbers do ("type" or "rope_type", ints or floats)."""
    if key != "rope_scaling" or not isinstance(theirs, dict) or not isinstance(ours, dict):
        return False
    kind = theirs.get("type", theirs.get("rope_type"))
    return kind == "yarn" and all(theirs.get(k) == v for k, v in ours.items() if k != "type")
