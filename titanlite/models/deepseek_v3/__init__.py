"""The DeepSeek-V3 family: multi-head latent attention, dense then mixture-of-experts blocks (DeepSeek-V3
671B, and Moonlight-16B-A3B's shapes as 16B); multi-token prediction with model.mtp_layers (mtp.py)."""

from titanlite.models import ModelSpec
from titanlite.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from titanlite.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from titanlite.models.deepseek_v3.model import DeepSeekV3
from titanlite.models.deepseek_v3.parallelize import apply_tp


def flops_per_token(model: DeepSeekV3, seq_len: int) -> float:
    """Llama's count (torchtitan's convention): 6 per ACTIVE matmul parameter (the token embedding, a
    lookup, and the experts a token is not routed to excluded; the router and shared experts count),
    plus the attention scores and weighted sums, 6 * layers * heads * (qk_head_dim + v_head_dim) *
    seq_len: MLA's scores run over nope + rope dimensions, its weighted sum over v_head_dim ones.
    Causal masking is not discounted (see titanlite.models.llama.flops_per_token)."""
    a = model.args
    attention = 6 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    return float(6 * model.num_params(exclude_embedding=True, active=True) + attention)


DEEPSEEK_V3_SPEC = ModelSpec(
    "deepseek_v3", DeepSeekV3, DEEPSEEK_V3_FLAVORS, apply_tp, flops_per_token, hf_adapter=DeepSeekV3HFAdapter()
)
SPECS = (DEEPSEEK_V3_SPEC,)
__all__ = ["DEEPSEEK_V3_SPEC", "DeepSeekV3", "DeepSeekV3Args", "flops_per_token"]
