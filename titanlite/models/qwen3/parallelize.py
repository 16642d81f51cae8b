"""Qwen3's tensor-parallel plans: Llama's (dense) or Mixtral's expert parallelism (MoE), plus the
per-head q/k norms. Their input holds this rank's heads (dim 2 of [B, T, heads, head_dim]), so
they run as sequence-parallel over dim 2: a replicated weight whose gradient, a partial sum over
the local heads, is summed over the TP ranks."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from titanlite.models.llama.parallelize import attention_plan, swiglu_plan
from titanlite.models.mixtral.parallelize import ExpertParallel
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import apply_tp_plan, vocab_parallel_plan


def _qk_norm_plan() -> dict:
    return {
        f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True) for norm in ("q_norm", "k_norm")
    }


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    block_plan = {**attention_plan(), **_qk_norm_plan(), **swiglu_plan()}
    apply_tp_plan(model, dims.tp_mesh, vocab_parallel_plan(loss_parallel), block_plan, sequence_parallel)


def apply_moe_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    block_plan = {**attention_plan(), **_qk_norm_plan(), "feed_forward": ExpertParallel()}
    apply_tp_plan(model, dims.tp_mesh, vocab_parallel_plan(loss_parallel), block_plan, sequence_parallel)
