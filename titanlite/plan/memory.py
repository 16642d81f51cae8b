"""One rank's memory at its peak: exact state from the real shards, activations from the tally,
FSDP's buffers from the block sizes, and a stated margin for what the allocator cannot give back.

The peak is the largest of two moments, three under GRPO: the start of backward (state + activations + gathered
parameters), the optimizer step (state + all gradients + the step's temporaries) and GRPO's rollout (state + the
gathered policy, KV cache and logits of plan/rollout.py).

A compiled step's activations lie between two tallies (plan/activations.py): the eager step's (the
upper bound) and what is left when every tensor the min-cut partitioner may recompute costs nothing
(the lower bound). The peak printed is that range, and its point estimate takes COMPILED_KEPT of the
way from the lower to the upper bound.
"""

from dataclasses import dataclass

from titanlite.config_sections import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.parallel.dims import ParallelDims
from titanlite.plan.activations import Activations

ALLOCATOR_MARGIN = 0.05  # fragmentation of the CUDA caching allocator, as a share of the peak
CONTEXT_GIB = 1.0  # CUDA context, NCCL channels and cuBLAS workspaces, outside the allocator's count
GIB = 2**30
# Share of the eager-over-lower-bound activations a compiled step keeps: fitted (scripts/fit_planner.py)
# on the compiled tuning rows of plan/published_table.py, titanlite's 1B on one H100 and torchtitan's 8B
# on 8 H100s.
COMPILED_KEPT = 0.327


@dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int  # peak of the forward + backward tally (this rank's gradient shards included)
    buffers: int  # FSDP's gathered parameters and reduce-scatter inputs
    peak: int  # what torch.cuda.max_memory_allocated should read
    peak_range: tuple[int, int] | None  # compiled: the peak at the lower and the upper (eager) bound
    needs: int  # peak with the allocator margin and the CUDA context
    capacity: int
    reference: int = 0  # DPO's frozen reference model (dpo.py), sharded like the parameters; 0 without one
    rollout: int = 0  # GRPO: what its rollout holds besides the state (plan/rollout.py: gathered weights, KV cache)

    @property
    def share(self) -> float:
        return self.needs / self.capacity

    @property
    def fits(self) -> bool:
        return self.needs <= self.capacity


def fsdp_buffers(cfg: JobConfig, block: int, root: int, dims: ParallelDims) -> int:
    """The block (of `block` parameters) in use and the next one prefetched, gathered in the compute
    dtype; the `root` parameters (embedding, norm, output of this rank's stages), which the default
    reshard policy keeps gathered; one block's gradients cast to the reduce dtype for the
    reduce-scatter. All split over tp."""
    if not dims.fsdp_enabled:
        return 0
    training = cfg.training
    compute, reduce = DTYPES[training.mixed_precision_param].itemsize, DTYPES[training.mixed_precision_reduce].itemsize
    kept_root = root if cfg.parallelism.fsdp_reshard_after_forward != "always" else 0
    return (kept_root * compute + 2 * block * compute + block * reduce) // dims.tp


def pipeline_fsdp_buffers(cfg: JobConfig, held: int, trained: int, dims: ParallelDims) -> int:
    """Under PP, torch's PipelineStage runs every microbatch's backward without FSDP's gradient sync and
    without resharding after backward (torch.distributed.pipelining's backward_maybe_with_nosync) and reduces
    once after the last: from the first backward to the step's end the rank holds its stages' `held`
    parameters gathered in the compute dtype and the unsharded gradients of the `trained` ones, which FSDP
    accumulates in the reduce dtype (FSDPParam.to_accumulated_grad_if_needed), beside the in-flight
    microbatches' activations. All split over tp."""
    if not dims.fsdp_enabled:
        return 0
    training = cfg.training
    compute, reduce = DTYPES[training.mixed_precision_param].itemsize, DTYPES[training.mixed_precision_reduce].itemsize
    return (held * compute + trained * reduce) // dims.tp


def optimizer_temporaries(cfg: JobConfig, params: int) -> int:
    """foreach AdamW writes its intermediates out (one parameter-sized set, measured on CPU); the fused
    kernels (the GPU default) and AdamWBF16Kahan's compiled update write none."""
    foreach = cfg.optimizer.name != "AdamWBF16Kahan" and cfg.optimizer.implementation == "foreach"
    return params if foreach else 0


def plan_memory(
    cfg: JobConfig,
    state: dict[str, int],
    acts: Activations,
    buffers: int,
    capacity_gib: float,
    lower: Activations | None = None,
    rollout: int = 0,
) -> Memory:
    """`acts`: the eager tally; `lower`: a compiled step's lower bound (None when the blocks are not compiled);
    `rollout`: what GRPO's rollout holds besides the state, while no gradient is (a third moment of the peak)."""
    on_gpu = {k: 0 for k in state} if cfg.parallelism.fsdp_cpu_offload else state  # offload keeps them in CPU memory
    params, grads, optimizer = on_gpu["params"], on_gpu["grads"], on_gpu["optimizer"]
    reference = on_gpu.get("reference", 0)  # DPO's reference: offloaded like the parameters it copies

    def peak_with(activations: int) -> int:
        backward = params + reference + optimizer + activations + buffers
        step = params + reference + optimizer + grads + optimizer_temporaries(cfg, params)
        return max(backward, step, params + reference + optimizer + rollout)

    # Under PP the bounds are composed from per-block tallies (plan/pipeline.py), which can put the lower one
    # a little above the eager one: the eager count bounds both.
    least = acts.peak if lower is None else min(lower.peak, acts.peak)
    kept = int(least + COMPILED_KEPT * (acts.peak - least))
    peak = peak_with(kept)
    needs = int(peak * (1 + ALLOCATOR_MARGIN) + CONTEXT_GIB * GIB)
    bounds = None if lower is None else (peak_with(least), peak_with(acts.peak))
    return Memory(
        params, grads, optimizer, kept, buffers, peak, bounds, needs, int(capacity_gib * GIB), reference, rollout
    )
