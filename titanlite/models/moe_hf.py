"""Hugging Face layout of the shared MoE layer (models/moe.py): HF stores each expert's projections
as separate nn.Linear tensors, titanlite stacks them row-wise into one [experts * out, in] tensor per
projection. A mixin for the MoE families' adapters, which name the per-expert tensors."""

import re

import torch

from titanlite.errors import UserError

_STACKED = re.compile(r"^layers\.(\d+)\.feed_forward\.(w[123])$")


class StackedExpertsHFAdapter:
    """Put before the family's HFAdapter in the bases. `expert_name` is the HF template with {layer},
    {expert} and {projection}; `expert_projections` maps w1 / w2 / w3 to HF's projection names."""

    expert_name: str
    expert_projections: dict[str, str]

    def __init__(self):
        super().__init__()
        theirs = {hf: ours for ours, hf in self.expert_projections.items()}
        pattern = re.escape(self.expert_name).replace(r"\{layer\}", r"(?P<layer>\d+)")
        pattern = pattern.replace(r"\{expert\}", r"(?P<expert>\d+)").replace(r"\{projection\}", r"(?P<projection>\w+)")
        self._per_expert = re.compile(f"^{pattern}$")
        self._their_projection = theirs

    def _expert_hf_name(self, layer: str, expert: int, projection: str) -> str:
        return self.expert_name.format(layer=layer, expert=expert, projection=self.expert_projections[projection])

    def _expert_match(self, hf_name: str):
        """(layer, expert, our projection) of a per-expert HF tensor, else None."""
        match = self._per_expert.match(hf_name)
        if match is None or match["projection"] not in self._their_projection:
            return None
        return match["layer"], int(match["expert"]), self._their_projection[match["projection"]]

    def hf_names(self, name: str, args) -> list[str]:
        stacked = _STACKED.match(name)
        if stacked is None:
            return super().hf_names(name, args)
        layer, projection = stacked.groups()
        return [self._expert_hf_name(layer, e, projection) for e in range(args.num_experts)]

    def to_hf(self, state_dict, args):
        experts = {name: t for name, t in state_dict.items() if _STACKED.match(name)}
        out = super().to_hf({name: t for name, t in state_dict.items() if name not in experts}, args)
        for name, stacked in experts.items():
            # Clones: safetensors refuses tensors that share memory, as views of one stack would.
            per_expert = stacked.view(args.num_experts, -1, stacked.shape[-1]).unbind(0)
            out.update(zip(self.hf_names(name, args), (t.clone() for t in per_expert)))
        return out

    def from_hf(self, hf_state_dict, args):
        rest = {name: t for name, t in hf_state_dict.items() if self._expert_match(name) is None}
        out = super().from_hf(rest, args)
        by_stack: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, tensor in hf_state_dict.items():
            match = self._expert_match(hf_name)
            if match:
                layer, expert, projection = match
                by_stack.setdefault(f"layers.{layer}.feed_forward.{projection}", {})[expert] = tensor
        for name, experts in by_stack.items():
            if sorted(experts) != list(range(args.num_experts)):
                raise UserError(
                    f"{name} needs experts 0..{args.num_experts - 1} from Hugging Face but got {sorted(experts)}; "
                    "the checkpoint has another number of experts"
                )
            out[name] = torch.cat([experts[e] for e in range(args.num_experts)])
        return out
