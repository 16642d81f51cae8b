"""The Mixtral family: sparse mixture-of-experts on Mistral's decoder (8x7B: 8 experts, top-2)."""

from titanlite.models import ModelSpec, parallelize_decoder
from titanlite.models.mixtral.args import MIXTRAL_FLAVORS, MixtralArgs
from titanlite.models.mixtral.hf_adapter import MixtralHFAdapter
from titanlite.models.mixtral.model import Mixtral


def flops_per_token(model: Mixtral, seq_len: int) -> float:
    """Llama's count (6 per matmul parameter + attention) over the ACTIVE parameters: a token goes
    through top_k of the experts, so the others cost it nothing. The router counts; attention
    spans at most sliding_window keys."""
    args = model.args
    attended = seq_len if args.sliding_window is None else min(seq_len, args.sliding_window)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * attended
    return float(6 * model.num_params(exclude_embedding=True, active=True) + attention)


MIXTRAL_SPEC = ModelSpec("mixtral", Mixtral, MIXTRAL_FLAVORS, parallelize_decoder, flops_per_token, hf_adapter=MixtralHFAdapter())
SPECS = (MIXTRAL_SPEC,)
__all__ = ["MIXTRAL_SPEC", "Mixtral", "MixtralArgs", "flops_per_token"]
