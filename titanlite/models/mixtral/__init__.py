"""The Mixtral family: sparse mixture-of-experts on Mistral's decoder (8x7B: 8 experts, top-2)."""

from titanlite.models import ModelSpec
from titanlite.models.mistral import flops_per_token as mistral_flops_per_token
from titanlite.models.mixtral.args import MIXTRAL_FLAVORS, MixtralArgs
from titanlite.models.mixtral.hf_adapter import MixtralHFAdapter
from titanlite.models.mixtral.model import Mixtral
from titanlite.models.mixtral.parallelize import apply_tp


def flops_per_token(model: Mixtral, seq_len: int) -> float:
    """Mistral's count (6 per matmul parameter + windowed attention) over the ACTIVE parameters: a
    token goes through top_k of the experts, so the others cost it nothing. The router counts."""
    idle = model.num_params(exclude_embedding=True) - model.num_params(exclude_embedding=True, active=True)
    return mistral_flops_per_token(model, seq_len) - 6 * idle


MIXTRAL_SPEC = ModelSpec("mixtral", Mixtral, MIXTRAL_FLAVORS, apply_tp, flops_per_token, hf_adapter=MixtralHFAdapter())
SPECS = (MIXTRAL_SPEC,)
__all__ = ["MIXTRAL_SPEC", "Mixtral", "MixtralArgs", "flops_per_token"]
