"""Mixtral <-> Hugging Face MixtralForCausalLM.

Llama's names for attention and norms; the router is block_sparse_moe.gate and each expert's
projections are separate tensors (block_sparse_moe.experts.E.w1 / w2 / w3, nn.Linear layout),
which titanlite stacks row-wise (models/moe_hf.py).
"""

from titanlite.models.hf import required
from titanlite.models.llama.hf_adapter import LlamaHFAdapter
from titanlite.models.mistral.hf_adapter import MistralHFAdapter
from titanlite.models.mixtral.args import MixtralArgs
from titanlite.models.moe_hf import StackedExpertsHFAdapter


class MixtralHFAdapter(StackedExpertsHFAdapter, MistralHFAdapter):
    architectures = ["MixtralForCausalLM"]
    model_type = "mixtral"
    args_class = MixtralArgs
    names = {
        **{ours: theirs for ours, theirs in LlamaHFAdapter.names.items() if ".feed_forward." not in ours},
        "layers.{}.feed_forward.gate.weight": "model.layers.{}.block_sparse_moe.gate.weight",
    }
    shape_keys = (*LlamaHFAdapter.shape_keys, "num_local_experts")
    expert_name = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{projection}.weight"
    expert_projections = {"w1": "w1", "w2": "w2", "w3": "w3"}

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        config["num_local_experts"] = args.num_experts
        config["num_experts_per_tok"] = args.top_k
        return config

    def args_fields(self, config: dict) -> dict:
        return {
            **super().args_fields(config),
            "sliding_window": config.get("sliding_window"),  # MixtralConfig: none
            "num_experts": required(config, "num_local_experts"),
            "top_k": config.get("num_experts_per_tok", 2),
        }
