"""The Llama family: Llama 2 and Llama 3 / 3.1 / 3.2 share one architecture, differing in flavors."""

from titanlite.models import ModelSpec
from titanlite.models.llama.args import LLAMA2_FLAVORS, LLAMA3_FLAVORS
from titanlite.models.llama.hf_adapter import LlamaHFAdapter
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.parallelize import apply_tp


def flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token, as in the PaLM paper and torchtitan.

    6 per matmul parameter (2 forward, 4 backward), counting every parameter except the token
    embedding table, which is a lookup (when tied, the shared matrix is counted once, as the
    output projection it also is); plus 12 * layers * heads * head_dim * seq_len for the
    attention scores and weighted sum (forward and backward). Masked-out scores are not discounted:
    neither the causal half nor, under model.attention_mask block_causal, the other documents' keys
    (torchtitan's convention, "we follow the convention and do not account for sparsity in causal
    attention", torchtitan/models/utils.py), so MFU does not depend on where documents end.
    """
    args = model.args
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * model.num_params(exclude_embedding=True) + attention)


LLAMA3_SPEC = ModelSpec("llama3", Transformer, LLAMA3_FLAVORS, apply_tp, flops_per_token, hf_adapter=LlamaHFAdapter())
LLAMA2_SPEC = ModelSpec("llama2", Transformer, LLAMA2_FLAVORS, apply_tp, flops_per_token, hf_adapter=LlamaHFAdapter())
SPECS = (LLAMA3_SPEC, LLAMA2_SPEC)
