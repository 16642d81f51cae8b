"""Mixtral <-> Hugging Face MixtralForCausalLM.

Llama's names for attention and norms; the router is block_sparse_moe.gate and each expert's
projections are separate tensors (block_sparse_moe.experts.E.w1 / w2 / w3, nn.Linear layout),
which titanlite stacks row-wise into one [experts * out, in] tensor per projection.
"""

import re

import torch

from titanlite.errors import UserError
from titanlite.models.llama.hf_adapter import LlamaHFAdapter
from titanlite.models.mistral.hf_adapter import MistralHFAdapter

_STACKED = re.compile(r"^layers\.(\d+)\.feed_forward\.(w[123])$")
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _expert_name(layer: str, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{projection}.weight"


class MixtralHFAdapter(MistralHFAdapter):
    architectures = ["MixtralForCausalLM"]
    model_type = "mixtral"
    names = {
        **{ours: theirs for ours, theirs in LlamaHFAdapter.names.items() if ".feed_forward." not in ours},
        "layers.{}.feed_forward.gate.weight": "model.layers.{}.block_sparse_moe.gate.weight",
    }
    shape_keys = (*LlamaHFAdapter.shape_keys, "num_local_experts")

    def hf_names(self, name: str, args) -> list[str]:
        stacked = _STACKED.match(name)
        if stacked is None:
            return super().hf_names(name, args)
        layer, projection = stacked.groups()
        return [_expert_name(layer, e, projection) for e in range(args.num_experts)]

    def to_hf(self, state_dict, args):
        experts = {name: t for name, t in state_dict.items() if _STACKED.match(name)}
        out = super().to_hf({name: t for name, t in state_dict.items() if name not in experts}, args)
        for name, stacked in experts.items():
            # Clones: safetensors refuses tensors that share memory, as views of one stack would.
            per_expert = stacked.view(args.num_experts, -1, stacked.shape[-1]).unbind(0)
            out.update(zip(self.hf_names(name, args), (t.clone() for t in per_expert)))
        return out

    def from_hf(self, hf_state_dict, args):
        rest = {name: t for name, t in hf_state_dict.items() if not _PER_EXPERT.match(name)}
        out = super().from_hf(rest, args)
        by_stack: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, tensor in hf_state_dict.items():
            match = _PER_EXPERT.match(hf_name)
            if match:
                layer, expert, projection = match.groups()
                by_stack.setdefault(f"layers.{layer}.feed_forward.{projection}", {})[int(expert)] = tensor
        for name, experts in by_stack.items():
            if sorted(experts) != list(range(args.num_experts)):
                raise UserError(
                    f"{name} needs experts 0..{args.num_experts - 1} from Hugging Face but got {sorted(experts)}; "
                    "the checkpoint has another num_local_experts"
                )
            out[name] = torch.cat([experts[e] for e in range(args.num_experts)])
        return out

    def hf_config(self, args, dtype: str = "float32") -> dict:
        config = super().hf_config(args, dtype)
        config["num_local_experts"] = args.num_experts
        config["num_experts_per_tok"] = args.top_k
        return config
