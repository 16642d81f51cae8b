"""The Qwen3 families: dense Qwen3 (0.6B to 32B) and Qwen3 MoE (30B-A3B, 235B-A22B)."""

from titanlite.models import ModelSpec
from titanlite.models.llama import flops_per_token as llama_flops_per_token
from titanlite.models.mixtral import flops_per_token as moe_flops_per_token
from titanlite.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args, Qwen3MoeArgs
from titanlite.models.qwen3.hf_adapter import Qwen3HFAdapter, Qwen3MoeHFAdapter
from titanlite.models.qwen3.model import Qwen3, Qwen3Moe
from titanlite.models.qwen3.parallelize import apply_moe_tp, apply_tp

QWEN3_SPEC = ModelSpec("qwen3", Qwen3, QWEN3_FLAVORS, apply_tp, llama_flops_per_token, hf_adapter=Qwen3HFAdapter())
QWEN3_MOE_SPEC = ModelSpec(
    "qwen3_moe", Qwen3Moe, QWEN3_MOE_FLAVORS, apply_moe_tp, moe_flops_per_token, hf_adapter=Qwen3MoeHFAdapter()
)
SPECS = (QWEN3_SPEC, QWEN3_MOE_SPEC)
__all__ = ["QWEN3_SPEC", "QWEN3_MOE_SPEC", "Qwen3", "Qwen3Args", "Qwen3Moe", "Qwen3MoeArgs"]
