"""The Mistral family: Mistral 7B v0.1 (sliding-window attention) and Mathstral 7B."""

from titanlite.models import ModelSpec
from titanlite.models.llama import flops_per_token as llama_flops_per_token
from titanlite.models.llama.parallelize import apply_tp
from titanlite.models.mistral.args import MISTRAL_FLAVORS, MistralArgs
from titanlite.models.mistral.hf_adapter import MistralHFAdapter
from titanlite.models.mistral.model import Mistral


def flops_per_token(model: Mistral, seq_len: int) -> float:
    """Llama's count, with each query attending to at most sliding_window keys instead of seq_len."""
    window = getattr(model.args, "sliding_window", None)  # MoE families built on Mixtral (Qwen3 MoE) have none
    return llama_flops_per_token(model, seq_len if window is None else min(seq_len, window))


MISTRAL_SPEC = ModelSpec("mistral", Mistral, MISTRAL_FLAVORS, apply_tp, flops_per_token, hf_adapter=MistralHFAdapter())
SPECS = (MISTRAL_SPEC,)
__all__ = ["MISTRAL_SPEC", "Mistral", "MistralArgs", "flops_per_token"]
