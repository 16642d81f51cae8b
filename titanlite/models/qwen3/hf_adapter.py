"""Qwen3 <-> Hugging Face Qwen3ForCausalLM and Qwen3MoeForCausalLM.

Llama's names plus self_attn.q_norm / k_norm. Those norms act on one head's head_dim values, which
Llama's RoPE permutation reorders (Meta's adjacent pairs vs HF's halves), so their weights are
permuted as one head's rows of wq / wk are. Qwen3 MoE's router is mlp.gate and its experts are
mlp.experts.E.gate_proj / down_proj / up_proj, stacked as Mixtral's (models/moe_hf.py).
"""

import torch

from titanlite.models.hf import required, rope_halves_to_pairs, rope_pairs_to_halves
from titanlite.models.llama.hf_adapter import LlamaHFAdapter
from titanlite.models.moe_hf import StackedExpertsHFAdapter
from titanlite.models.qwen3.args import Qwen3Args, Qwen3MoeArgs


def _as_one_head(reorder, tensor: torch.Tensor) -> torch.Tensor:
    return reorder(tensor.unsqueeze(-1), 1).squeeze(-1)


class Qwen3HFAdapter(LlamaHFAdapter):
    architectures = ["Qwen3ForCausalLM"]
    model_type = "qwen3"
    args_class = Qwen3Args
    names = {
        **LlamaHFAdapter.names,
        "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
        "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    }
    shape_keys = (*LlamaHFAdapter.shape_keys, "head_dim")

    def tensor_to_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return _as_one_head(rope_pairs_to_halves, tensor)
        return super().tensor_to_hf(name, tensor, args)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return _as_one_head(rope_halves_to_pairs, tensor)
        return super().tensor_from_hf(name, tensor, args)

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        config.pop("mlp_bias")  # Qwen3Config has none
        config.update(use_sliding_window=False, sliding_window=None)
        return config

    def args_fields(self, config: dict) -> dict:
        fields = super().args_fields(config)
        return {**fields, "head_dim": config.get("head_dim") or fields["dim"] // fields["n_heads"]}


class Qwen3MoeHFAdapter(StackedExpertsHFAdapter, Qwen3HFAdapter):
    architectures = ["Qwen3MoeForCausalLM"]
    model_type = "qwen3_moe"
    args_class = Qwen3MoeArgs
    names = {
        **{ours: theirs for ours, theirs in Qwen3HFAdapter.names.items() if ".feed_forward." not in ours},
        "layers.{}.feed_forward.gate.weight": "model.layers.{}.mlp.gate.weight",
    }
    shape_keys = (*Qwen3HFAdapter.shape_keys, "num_experts", "moe_intermediate_size")
    expert_name = "model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"
    expert_projections = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        config.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config["intermediate_size"] = args.intermediate_size  # the dense MLP's, which all-sparse blocks never build
        return config

    def args_fields(self, config: dict) -> dict:
        experts = config.get("num_experts") or config.get("num_local_experts")  # transformers 5 writes the second
        if experts is None:
            required(config, "num_experts")
        return {
            **super().args_fields(config),
            "num_experts": experts,
            "top_k": config.get("num_experts_per_tok", 8),
            "moe_intermediate_size": required(config, "moe_intermediate_size"),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        }  # Qwen3MoeConfig's default
