"""The GPT-2 family: OpenAI's four sizes and the simple FSDP trainer's 2.6B."""

from titanlite.models import ModelSpec
from titanlite.models.gpt2.args import GPT2_FLAVORS, GPT2Args
from titanlite.models.gpt2.hf_adapter import GPT2HFAdapter
from titanlite.models.gpt2.model import GPT2
from titanlite.models.gpt2.parallelize import apply_tp
from titanlite.models.llama import flops_per_token  # same formula; num_params knows what GPT-2 excludes

GPT2_SPEC = ModelSpec("gpt2", GPT2, GPT2_FLAVORS, apply_tp, flops_per_token, hf_adapter=GPT2HFAdapter())
SPECS = (GPT2_SPEC,)
__all__ = ["GPT2", "GPT2Args", "GPT2_SPEC"]
