"""Step time from FLOPs and bytes: compute at an achievable share of the GPU's peak
(hardware.EFFICIENCY), collectives at the links' bandwidth (hardware.COLLECTIVE_EFFICIENCY).

Overlap model: FSDP's all-gathers and reduce-scatters run on their own stream, prefetched a block
ahead, so only the part longer than the compute shows; TP's collectives sit between the matmuls
that need them and are all exposed; a pipeline adds its bubble (plan/pipeline.py's bubble, per
schedule) and its send/recv between stages, counted as exposed (torch's schedules wait for each
receive before the stage's compute). Under PP each rank runs and gathers only its share of the layers.
"""

from dataclasses import dataclass

from titanlite.config_sections import JobConfig
from titanlite.parallel.ac import every_nth
from titanlite.parallel.dims import ParallelDims
from titanlite.dtypes import DTYPES
from titanlite.plan.pipeline import bubble, send_recv_bytes
from titanlite.plan.hardware import COLLECTIVE_EFFICIENCY, EAGER_SLOWDOWN, Gpu, efficiency


@dataclass(frozen=True)
class Speed:
    compute_s: float
    fsdp_s: float
    tp_s: float
    pp_s: float  # sending activations and their gradients between stages
    bubble: float  # idle share of the step (pipeline)
    step_s: float
    tps: float  # tokens per second per GPU, as the trainer counts them
    mfu: float  # percent of the bf16 peak, as metrics.py computes it
    tokens_per_day: float  # the whole job
    gpu_hours_per_billion: float


def recompute_share(cfg: JobConfig) -> float:
    """Extra FLOPs of AC's recompute, as a share of the step's (forward = 1/3 of 6 per parameter)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return 1 / 3
    if ac.mode == "selective":
        every = every_nth(ac.selective_ac_option)
        return 1 / 6 if every is None else 1 / (3 * every)  # op: every second matmul is recomputed
    return 0.0


def plan_speed(cfg: JobConfig, gpu: Gpu, dims: ParallelDims, args, flops_per_token: float, block_params: int,
               total_params: int, accum: int, intra_gbps: float, inter_gbps: float, gpus_per_node: int) -> Speed:
    training = cfg.training
    tokens = training.local_batch_size * training.seq_len * accum / dims.model_parallel_degree  # per GPU per step
    flops = tokens * flops_per_token * (1 + recompute_share(cfg))
    dtype = "bfloat16" if training.mixed_precision_param == "bfloat16" else "float32"
    rate = gpu.bf16_tflops * 1e12 * efficiency(gpu, dtype)
    if cfg.float8.enable:  # the blocks' Linear layers run in float8; attention, the output and the rest do not
        fp8_flops = min(flops, tokens * 6 * block_params * args.n_layers * (1 + recompute_share(cfg)))
        compute = fp8_flops / (gpu.fp8_tflops * 1e12 * efficiency(gpu, "float8")) + (flops - fp8_flops) / rate
    else:
        compute = flops / rate
    if not cfg.compile.enable:
        compute /= EAGER_SLOWDOWN
    compute_bytes = DTYPES[training.mixed_precision_param].itemsize
    reduce_bytes = DTYPES[training.mixed_precision_reduce].itemsize

    def seconds(nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e9 * COLLECTIVE_EFFICIENCY)

    fsdp = 0.0
    if dims.fsdp_enabled:
        n, local = dims.dp_shard, total_params / (dims.tp * dims.pp)
        within_node = dims.dp_shard * dims.tp <= gpus_per_node
        gathers = 1 if cfg.parallelism.fsdp_reshard_after_forward == "never" else 2  # forward, and again in backward
        per_micro = local * (n - 1) / n * (gathers * compute_bytes + reduce_bytes)
        fsdp = accum * seconds(per_micro, intra_gbps if within_node else inter_gbps)
        if dims.dp_replicate > 1:  # HSDP: all-reduce of the shards' gradients across replicas (other nodes)
            r = dims.dp_replicate
            fsdp += accum * seconds(2 * local / n * reduce_bytes * (r - 1) / r, inter_gbps)
    tp = 0.0
    if dims.tp_enabled:  # sequence parallel: 2 all-gathers + 2 reduce-scatters per block forward, the same in backward
        t = dims.tp
        activation = training.local_batch_size * training.seq_len * args.dim * compute_bytes * (t - 1) / t
        passes = 3 if cfg.activation_checkpoint.mode == "full" else 2  # full AC repeats the forward's
        tp = accum * seconds(4 * passes * args.n_layers / dims.pp * activation, intra_gbps)
    across_nodes = dims.dp_degree * dims.tp >= gpus_per_node  # pp is outermost: stage neighbours sit on other nodes
    pp = accum * seconds(send_recv_bytes(cfg, dims.pp, dims.tp, args.dim, compute_bytes), inter_gbps if across_nodes else intra_gbps)
    idle = bubble(cfg, dims.pp)
    step = (compute + max(0.0, fsdp - compute) + tp + pp) / (1 - idle)
    tps = tokens / step
    world = dims.dp_degree * dims.model_parallel_degree
    return Speed(compute, fsdp, tp, pp, idle, step, tps, 100 * tps * flops_per_token / (gpu.bf16_tflops * 1e12),
                 tps * world * 86400, 1e9 / tps / 3600)
