"""Llama's tensor-parallel plan (Llama 2, Llama 3, Mistral and Mixtral's attention share it)."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import apply_tp_plan, colwise, gather_sequence, rowwise_to_sequence, vocab_parallel_plan


def attention_plan() -> dict:
    """wq/wk/wv column-wise (whole heads per rank: TP divides n_heads and n_kv_heads), wo row-wise;
    the attention's other inputs (RoPE tables, the mask) are not sharded."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence(extra_inputs=3),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise_to_sequence(),
        "ffn_norm": SequenceParallel(),
    }


def swiglu_plan() -> dict:
    """SwiGLU w1/w3 column-wise, w2 row-wise."""
    return {
        "feed_forward": gather_sequence(),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise_to_sequence(),
    }


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    block_plan = {**attention_plan(), **swiglu_plan()}
    apply_tp_plan(model, dims.tp_mesh, vocab_parallel_plan(loss_parallel), block_plan, sequence_parallel)
