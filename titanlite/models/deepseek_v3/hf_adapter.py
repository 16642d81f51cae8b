"""DeepSeek-V3 <-> Hugging Face DeepseekV3ForCausalLM (the layout of deepseek-ai/DeepSeek-V3 and
moonshotai/Moonlight-16B-A3B on the Hub, and of transformers' save_pretrained).

One to one, no permutation: DeepSeek stores RoPE dimensions as adjacent pairs, titanlite's layout
(config.json rope_interleave true; transformers rotates them the same way). Multi-token prediction
depth k (titanlite's mtp.<k-1>.*, models/deepseek_v3/mtp.py) is HF's model.layers.<num_hidden_layers + k - 1>.*:
enorm, hnorm, eh_proj, the block's tensors under their usual names, shared_head.norm, and copies of the
shared matrices, embed_tokens and shared_head.head, which an export writes and an import checks against
the model's own (one sentence where they differ). They are read only with model.mtp_layers. The MoE blocks'
router is mlp.gate (its aux-loss-free bias mlp.gate.e_score_correction_bias), the shared experts one
SwiGLU mlp.shared_experts, the routed experts mlp.experts.E.*, stacked as Mixtral's (models/moe_hf.py).
"""

import re

import torch

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
_BEHAVIOUR_KEYS = (
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "rope_theta",
    "rope_scaling",
    "rope_interleave",
    "rms_norm_eps",
    "tie_word_embeddings",
)


class DeepSeekV3HFAdapter(StackedExpertsHFAdapter, HFAdapter):
    architectures = ["DeepseekV3ForCausalLM"]
    model_type = "deepseek_v3"
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{}.attention_norm.weight": _LAYER + "input_layernorm.weight",
        "layers.{}.ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
        **{f"layers.{{}}.{ours}": _LAYER + theirs for ours, theirs in _ATTENTION.items()},
        **{
            f"layers.{{}}.feed_forward.{ours}.weight": _LAYER + f"mlp.{theirs}.weight"
            for ours, theirs in _DENSE.items()
        },
        "layers.{}.feed_forward.gate.weight": _LAYER + "mlp.gate.weight",
        "layers.{}.feed_forward.expert_bias": _LAYER + "mlp.gate.e_score_correction_bias",
        **{
            f"layers.{{}}.feed_forward.shared_experts.{ours}.weight": _LAYER + f"mlp.shared_experts.{theirs}.weight"
            for ours, theirs in _DENSE.items()
        },
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        # an MTP depth's own tensors, in the layer numbering of _mtp_as_layer
        **{f"layers.{{}}.{ours}.weight": _LAYER + f"{ours}.weight" for ours in ("enorm", "hnorm", "eh_proj")},
        "layers.{}.mtp_norm.weight": _LAYER + "shared_head.norm.weight",
    }
    ignored = (r"\.rotary_emb\.inv_freq$",)
    expert_name = _LAYER.replace("{}", "{layer}") + "mlp.experts.{expert}.{projection}.weight"
    expert_projections = _DENSE
    shape_keys = (
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "first_k_dense_replace",
    )
    free_keys = ("num_nextn_predict_layers",)  # MTP layers beyond model.mtp_layers are not read

    def hf_names(self, name: str, args) -> list[str]:
        names = super().hf_names(_mtp_as_layer(name, args.n_layers), args)
        return names + [self._copy_name(name, args, depth) for depth in range(args.mtp_layers) if name in _COPIES]

    def _copy_name(self, name: str, args, depth: int) -> str:
        return _LAYER.format(args.n_layers + depth) + _COPIES[name]

    def to_hf(self, state_dict, args):
        out = super().to_hf({_mtp_as_layer(name, args.n_layers): t for name, t in state_dict.items()}, args)
        for name in _COPIES.keys() & state_dict.keys():  # clones: safetensors refuses tensors sharing memory
            out.update({self._copy_name(name, args, d): state_dict[name].clone() for d in range(args.mtp_layers)})
        return out

    def from_hf(self, hf_state_dict, args):
        copies = {
            n: hf_state_dict[n]
            for name in _COPIES
            for d in range(args.mtp_layers)
            if (n := self._copy_name(name, args, d)) in hf_state_dict
        }
        out = super().from_hf({n: t for n, t in hf_state_dict.items() if n not in copies}, args)
        for hf_name, copy in copies.items():
            shared = next(out[name] for name, suffix in _COPIES.items() if hf_name.endswith(suffix))
            if not torch.equal(copy, shared):
                raise UserError(
                    f"the Hugging Face tensor {hf_name} differs from the model's own matrix, which titanlite's "
                    "multi-token prediction shares; set model.mtp_layers 0 to leave the MTP layers out"
                )
        return {_layer_as_mtp(name, args.n_layers): t for name, t in out.items()}

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
            "num_nextn_predict_layers": args.mtp_layers,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None
            if yarn is None
            else {
                "type": "yarn",
                "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_seq_len,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
                "mscale": yarn.mscale,
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
            raise UserError(
                f"its config.json has rope_type {rope['rope_type']}, which titanlite's DeepSeek-V3 does not "
                "compute (it knows default and yarn)"
            )
        yarn = (
            None
            if rope["rope_type"] == "default"
            else YarnScaling(
                factor=float(rope["factor"]),
                original_max_seq_len=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32.0)),
                beta_slow=float(rope.get("beta_slow", 1.0)),
                mscale=float(rope.get("mscale", 1.0)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 1.0)),
            )
        )
        shapes = {
            ours: required(config, key)
            for ours, key in (
                ("dim", "hidden_size"),
                ("n_layers", "num_hidden_layers"),
                ("n_heads", "num_attention_heads"),
                ("vocab_size", "vocab_size"),
                ("ffn_hidden_dim", "intermediate_size"),
                ("kv_lora_rank", "kv_lora_rank"),
                ("qk_nope_head_dim", "qk_nope_head_dim"),
                ("qk_rope_head_dim", "qk_rope_head_dim"),
                ("v_head_dim", "v_head_dim"),
                ("num_experts", "n_routed_experts"),
                ("moe_hidden_dim", "moe_intermediate_size"),
            )
        }
        return DeepSeekV3Args(
            **shapes,
            q_lora_rank=config.get("q_lora_rank") or 0,
            n_dense_layers=config.get("first_k_dense_replace", 3),
            num_shared_experts=config.get("n_shared_experts", 1),
            top_k=config.get("num_experts_per_tok", 8),
            n_group=config.get("n_group", 8),
            topk_group=config.get("topk_group", 4),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=yarn,
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def left_out(self, config: dict, args) -> str | None:
        held = config.get("num_nextn_predict_layers") or 0
        if held <= args.mtp_layers:
            return None
        return (
            f"{held - args.mtp_layers} multi-token prediction layer(s) beyond model.mtp_layers {args.mtp_layers} "
            f"(config.json num_nextn_predict_layers {held}): they are not trained, and this run's exports leave them "
            f"out; set model.mtp_layers {held} to keep them"
        )

    def config_mismatch(self, config: dict, args) -> str | None:
        """As the shapes, the routing and RoPE settings must agree (absent keys take transformers'
        defaults, which are DeepSeek-V3's)."""
        mismatch = super().config_mismatch(config, args)
        if mismatch:
            return mismatch
        if args.mtp_layers > config.get("num_nextn_predict_layers", 0):
            return (
                f"its config.json has num_nextn_predict_layers {config.get('num_nextn_predict_layers', 0)}, fewer "
                f"than model.mtp_layers {args.mtp_layers}"
            )
        expected = self.hf_config(args)
        for key in _BEHAVIOUR_KEYS:
            if (
                key in config
                and config[key] != expected[key]
                and not _same_rope_scaling(key, config[key], expected[key])
            ):
                return f"its config.json has {key} {config[key]} where this model has {expected[key]}"
        return None


# The shared matrices an MTP layer carries a copy of, by their titanlite name: the HF name after its layer prefix.
_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_MTP = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.*)$")


def _mtp_as_layer(name: str, n_layers: int) -> str:
    """mtp.<k>.block.X -> layers.<n_layers + k>.X and mtp.<k>.norm.weight -> layers.<n_layers + k>.mtp_norm.weight
    (enorm, hnorm, eh_proj keep theirs): the numbering of HF's MTP layers; other names as they are."""
    match = _MTP.match(name)
    if match is None:
        return name
    depth, block, rest = match.groups()
    return f"layers.{n_layers + int(depth)}.{rest if block or rest != 'norm.weight' else 'mtp_norm.weight'}"


def _layer_as_mtp(name: str, n_layers: int) -> str:
    """The inverse of _mtp_as_layer."""
    match = _LAYER_NAME.match(name)
    if match is None or int(match.group(1)) < n_layers:
        return name
    depth, rest = int(match.group(1)) - n_layers, match.group(2)
    own = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj")
    return f"mtp.{depth}.{'norm.weight' if rest == 'mtp_norm.weight' else rest if own else 'block.' + rest}"


def _same_rope_scaling(key: str, theirs, ours) -> bool:
    """rope_scaling dicts agree when their YaRN numbers do ("type" or "rope_type", ints or floats)."""
    if key != "rope_scaling" or not isinstance(theirs, dict) or not isinstance(ours, dict):
        return False
    kind = theirs.get("type", theirs.get("rope_type"))
    return kind == "yarn" and all(theirs.get(k) == v for k, v in ours.items() if k != "type")
