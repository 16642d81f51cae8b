"""Step time from FLOPs and bytes, with the constants of plan/hardware.py.

Compute, per GPU: the matmuls (6 FLOPs per parameter per token) at MATMUL of the peak, attention (as
metrics.py counts it for MFU: the family's flops_per_token less the matmuls, for Llama 12 x layers x heads x
head_dim x seq_len per token, the whole window's score matrix with neither the causal half nor other
documents' keys discounted, so it grows with seq_len and dominates at long context) at ATTENTION of the
peak, which was measured on that count, and the memory-bound kernels (the elementwise ones,
float8's casts, the optimizer step) at BANDWIDTH of the HBM bandwidth. Matmuls grow with the square of
the model's width and the elementwise traffic with the width itself, so small models spend a larger
share of their step on memory-bound kernels: that, not a per-model constant, is why a 1B runs at a
different MFU than a 405B. A power-capped GPU runs its tensor cores at Gpu.clock of the peak.
Activation checkpointing adds its recompute: full AC the whole forward (a third of each kind of
work), every N-th block a third over N, op-level every second matmul's forward (a sixth of the
matmuls) and, without compile, the elementwise forward (compiled, the recompute fuses into the
backward's kernels).

Overlap model: FSDP's all-gathers and reduce-scatters run on their own stream, prefetched a block
ahead, so only the part longer than the compute of their own pass shows: the forward's all-gathers hide
behind the forward (a third of the work), the backward's all-gathers and reduce-scatters behind the
backward (the rest, with AC's recompute), and the optimizer step waits for the last reduce-scatter. A
backward whose collectives outlast it is not helped by a forward with room to spare; TP's collectives sit between the
matmuls
that need them and are all exposed, less the share of their bytes async TP hides by splitting them
into the matmuls; expert parallelism's two all-to-alls per MoE layer (dispatch and combine, in
forward, again in backward and in AC's repeated forward) are exposed too, each carrying the
rank's tokens x top_k rows (even routing, plan/moe.py); a pipeline adds its bubble
(plan/pipeline.py's bubble, per schedule) and its send/recv between stages, counted as exposed
(torch's schedules wait for each receive before the stage's compute). Under PP each rank runs and gathers only its share
of the layers.
Context parallelism (parallel/cp.py) gives each rank 1/cp of every window's tokens (each attending to the
whole window: the attention FLOPs per token are the whole window's), adds per layer the all-gathers of the
keys and values (forward, and again wherever AC recomputes the block) and the reduce-scatter of their
gradients (backward), exposed, as attention waits for them; FSDP's traffic runs among the dp_shard x cp ranks.
"""

from dataclasses import dataclass

from torch import nn

from titanlite.build import grad_accumulation_steps
from titanlite.config_sections import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.objectives import objective_class
from titanlite.parallel.ac import every_nth
from titanlite.parallel.dims import ParallelDims
from titanlite.plan import hardware
from titanlite.plan.hardware import Gpu
from titanlite.plan.moe import expert_params, moe_modules
from titanlite.plan.pipeline import bubble, send_recv_bytes
from titanlite.plan.rollout import rollout_seconds


@dataclass(frozen=True)
class Shape:
    """What the speed model reads of a model (the whole, unsharded one)."""

    n_layers: int
    dim: int
    vocab: int
    block_params: int  # the largest block's (MoE: the share a token uses)
    matmul_params: int  # num_params(exclude_embedding=True), MoE: active ones only: 6 FLOPs per token each
    total_params: int
    flops_per_token: float  # the model family's formula, as metrics.py uses it
    kv_width: int  # elements per token of one layer's keys and values, as attention receives them (what CP gathers)
    expert_params: int = 0  # MoE: all routed experts' (what EP splits)
    moe_layers: int = 0
    top_k: int = 0
    cast_width: int = 0  # float8: elements per token of what one block's linears cast (cast_widths)
    whole_cast_width: int = 0  # the share of it that sequence parallelism holds whole on every rank

    @classmethod
    def of(cls, whole, seq_len: int, flops_per_token: float) -> "Shape":
        args = whole.args
        largest = max(whole.layers.values(), key=lambda b: sum(p.numel() for p in b.parameters()))
        block = sum(p.numel() for p in largest.parameters())
        matmul = whole.num_params(exclude_embedding=True)
        # A token goes through top_k of the experts: the idle ones cost it neither matmuls nor traffic.
        active = whole.num_params(exclude_embedding=True, active=True) if hasattr(args, "num_experts") else matmul
        moes = moe_modules(whole)
        # DeepSeek's MLA gives every head a key of qk_head_dim and a value of v_head_dim; the others use head_dim for
        # both.
        key, value = (
            (args.qk_head_dim, args.v_head_dim) if hasattr(args, "qk_head_dim") else (args.head_dim, args.head_dim)
        )
        return cls(
            args.n_layers,
            args.dim,
            args.vocab_size,
            round(block * active / matmul),
            active,
            whole.num_params(),
            flops_per_token,
            args.n_kv_heads * (key + value),
            expert_params(whole),
            len(moes),
            moes[0].top_k if moes else 0,
            *cast_widths(largest, args.dim),
        )

    @property
    def width(self) -> float:
        """Units of elementwise traffic per token (hardware.ELEMENTWISE_BYTES)."""
        return self.n_layers * self.block_params / self.dim + self.vocab


def cast_widths(block: nn.Module, dim: int) -> tuple[int, int]:
    """Elements per token of the tensors a block's float8 linears cast, and of those among them that sequence
    parallelism holds whole on every rank. Each linear casts its output's gradient and its input, but the
    linears that read a sub-block's input (wq, wk, wv; w1, w3) read one tensor, whose casts a compiled block
    computes once (AOTAutograd's CSE merges them). Under TP that input is the all-gathered sequence, and the
    gradient of the sub-block's output projection (the last linear back to the model's width: wo, w2) arrives
    all-gathered in backward: two tensors per sub-block, whole on every rank (as count_sequence_gathers in
    plan/activations.py counts them for memory)."""
    total = whole = 0
    for part in (block.attention, block.feed_forward):
        linears = [m for m in part.modules() if isinstance(m, nn.Linear)]
        outputs = [m for m in linears if m.out_features == dim]
        output = outputs[-1] if outputs else None
        readers = [m for m in linears if m.in_features == dim and m is not output]
        total += sum(m.out_features for m in linears) + sum(m.in_features for m in linears if m not in readers)
        total += dim if readers else 0
        whole += (dim if readers else 0) + (dim if output is not None else 0)
    return total, whole


@dataclass(frozen=True)
class Speed:
    compute_s: float
    parts: tuple[tuple[str, float], ...]  # compute_s by kind of work
    fsdp_s: float
    tp_s: float
    ep_s: float  # expert parallelism's all-to-alls
    cp_s: float  # context parallelism's all-gathers of keys and values and reduce-scatters of their gradients
    pp_s: float  # sending activations and their gradients between stages
    bubble: float  # idle share of the step (pipeline)
    step_s: float
    tps: float  # tokens per second per (trainer) GPU, as the trainer counts them
    mfu: float  # percent of the bf16 peak, as metrics.py computes it
    tokens_per_day: float  # the whole job
    gpu_hours_per_billion: float
    rollout_s: float = 0.0  # GRPO: making the step's completions (plan/rollout.py), part of step_s


@dataclass(frozen=True)
class Recompute:
    """Extra work of AC's recompute (and of DPO's reference forward), as a share of the step's work of each kind."""

    matmul: float
    attention: float
    elementwise: float


def recompute(cfg: JobConfig) -> Recompute:
    """AC's recompute; DPO adds the reference model's forward on every sequence, a third more of each kind (counted
    with the recompute, though it runs before the policy's forward)."""
    ac = cfg.activation_checkpoint
    reference = 1 / 3 if objective_class(cfg).runs_reference_forward else 0.0
    if ac.mode == "full":
        return Recompute(1 / 3 + reference, 1 / 3 + reference, 1 / 3 + reference)
    if ac.mode == "selective":
        every = every_nth(ac.selective_ac_option)
        if every is not None:
            return Recompute(*[1 / (3 * every) + reference] * 3)
        return Recompute(1 / 6 + reference, reference, (0.0 if cfg.compile.enable else 1 / 3) + reference)
    return Recompute(reference, reference, reference)


def compute_parts(cfg: JobConfig, gpu: Gpu, shape: Shape, tokens: float, state_bytes: int, tp: int) -> dict[str, float]:
    """Seconds of each kind of work one GPU does in a step of `tokens` tokens (already divided over tp x pp)."""
    training = cfg.training
    redo = recompute(cfg)
    peak = gpu.bf16_tflops * 1e12 * gpu.clock * (0.5 if training.mixed_precision_param == "float32" else 1.0)
    bandwidth = gpu.hbm_tbps * 1e12 * hardware.BANDWIDTH
    matmul_flops = tokens * 6 * shape.matmul_params * (1 + redo.matmul)
    attention_flops = tokens * (shape.flops_per_token - 6 * shape.matmul_params) * (1 + redo.attention)
    elementwise = (
        tokens * shape.width * hardware.ELEMENTWISE_BYTES * DTYPES[training.mixed_precision_param].itemsize / 2
    )
    if not cfg.compile.enable:
        elementwise *= hardware.EAGER_ELEMENTWISE
    parts = {
        "matmuls": 0.0,
        "attention": attention_flops / (peak * hardware.ATTENTION[gpu.arch]),
        "elementwise": elementwise * (1 + redo.elementwise) / bandwidth,
        "optimizer": 2 * state_bytes / bandwidth,
    }  # read and written once per step
    matmul_rate = peak * hardware.MATMUL[gpu.arch]
    if cfg.float8.enable:  # the blocks' Linear layers run in float8; the output layer does not
        hardware.check_dtype(gpu, "float8")
        in_blocks = shape.n_layers * shape.block_params / shape.matmul_params
        float8_rate = gpu.fp8_tflops * 1e12 * gpu.clock * hardware.MATMUL[gpu.arch]
        parts["matmuls"] = matmul_flops * (in_blocks / float8_rate + (1 - in_blocks) / matmul_rate)
        width = shape.cast_width
        if cfg.float8.recipe_name == "rowwise":
            # No float8 TP styles for rowwise scales (parallel/tp.py, as torchtitan): each Float8Linear casts the
            # whole gathered tensors on every rank, tp times its share of them.
            width += (tp - 1) * shape.whole_cast_width
        casts = tokens * shape.n_layers * width * hardware.FLOAT8_CAST_BYTES[cfg.float8.recipe_name]
        parts["float8 casts"] = casts / bandwidth
    else:
        parts["matmuls"] = matmul_flops / matmul_rate
    return parts


def fsdp_seconds(
    cfg: JobConfig,
    dims: ParallelDims,
    shape: Shape,
    accum: int,
    seconds,
    intra: float,
    inter: float,
    gpus_per_node: int,
) -> tuple[float, float]:
    """(forward, backward) seconds of FSDP's collectives over the step: the all-gathers of this rank's layers in
    forward, in backward their all-gathers again (unless reshard_after_forward is never) and reduce-scatters;
    float8's all-gather moves the blocks' Linear weights in 1 byte."""
    if not dims.fsdp_enabled:
        return 0.0, 0.0
    training, n = cfg.training, dims.dp_shard * dims.cp  # FSDP shards over the flattened (dp_shard, cp)
    compute_bytes = DTYPES[training.mixed_precision_param].itemsize
    reduce_bytes = DTYPES[training.mixed_precision_reduce].itemsize
    local = shape.total_params / (dims.tp * dims.pp)
    gathers = 1 if cfg.parallelism.fsdp_reshard_after_forward == "never" else 2
    experts = shape.expert_params / (dims.tp * dims.pp)
    # Under EP a rank gathers and reduces only its E / ep experts, among the dp_shard / ep ranks holding them.
    groups = [(local - experts, n), (experts / dims.ep, n // dims.ep)]
    gather = sum((size - 1) / size * params * compute_bytes for params, size in groups)
    reduce = sum((size - 1) / size * params * reduce_bytes for params, size in groups)
    if cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather:
        in_float8 = shape.n_layers * shape.block_params / (dims.tp * dims.pp)
        gather -= (n - 1) / n * in_float8 * (compute_bytes - 1)
    gbps = intra if n * dims.tp <= gpus_per_node else inter
    forward = accum * seconds(gather, gbps)
    backward = accum * seconds((gathers - 1) * gather + reduce, gbps)
    if dims.dp_replicate > 1:  # HSDP: all-reduce of the shards' gradients across replicas (other nodes)
        r = dims.dp_replicate
        backward += accum * seconds(2 * local / n * reduce_bytes * (r - 1) / r, inter)
    return forward, backward


def forward_seconds(parts: dict[str, float], redo: Recompute) -> float:
    """The forward's share of compute_parts' work: a third of each kind (the backward computes two gradients per
    forward op), AC's recompute, which runs in the backward, left out; the optimizer step is neither."""
    again = {"matmuls": redo.matmul, "attention": redo.attention, "elementwise": redo.elementwise}
    return sum(seconds / (1 + again.get(kind, 0.0)) / 3 for kind, seconds in parts.items() if kind != "optimizer")


def tp_seconds(cfg: JobConfig, dims: ParallelDims, shape: Shape, accum: int, intra: float) -> tuple[float, float]:
    """(moving the bytes, waiting at the collectives) of sequence parallel: 2 all-gathers + 2 reduce-scatters
    per block forward, the same in backward (and in full AC's repeated forward); each collective also
    waits for the slowest of the tp ranks (hardware.TP_SYNC_S)."""
    if not dims.tp_enabled:
        return 0.0, 0.0
    training, t = cfg.training, dims.tp
    compute_bytes = DTYPES[training.mixed_precision_param].itemsize
    # torchao's tensorwise float8 TP styles cast before the all-gathers (half the collectives): 1 byte there.
    gathered_bytes = 1 if cfg.float8.enable and cfg.float8.recipe_name == "tensorwise" else compute_bytes
    tokens = training.local_batch_size * training.seq_len / dims.cp  # under CP the rank's share of each window
    activation = tokens * shape.dim * (compute_bytes + gathered_bytes) / 2 * (t - 1) / t
    # Forward and backward: 2 all-gathers and 2 reduce-scatters each; AC's recompute repeats the all-gathers,
    # and the reduce-scatters too except under op-level AC, whose policy saves them (parallel/ac.py).
    per_block = 8 + 2 * recomputed_blocks(cfg) + 2 * recomputed_blocks(cfg, saved_by_op_ac=True)
    collectives = accum * per_block * shape.n_layers / dims.pp
    return collectives * activation / (intra * 1e9 * hardware.COLLECTIVE_EFFICIENCY), collectives * hardware.TP_SYNC_S


def ep_seconds(
    cfg: JobConfig,
    dims: ParallelDims,
    shape: Shape,
    accum: int,
    seconds,
    intra: float,
    inter: float,
    gpus_per_node: int,
) -> float:
    """Expert parallelism's all-to-alls per step: dispatch and combine per MoE layer of this rank's stages, in
    forward, backward and full AC's repeated forward, each moving the (ep - 1) / ep of the rank's tokens x top_k
    rows that go to other ranks; within a node where the ep ranks (consecutive, inside tp) fit in one."""
    if dims.ep == 1 or not shape.moe_layers:
        return 0.0
    training = cfg.training
    rows = training.local_batch_size * training.seq_len * shape.top_k / dims.tp
    nbytes = rows * shape.dim * DTYPES[training.mixed_precision_param].itemsize * (dims.ep - 1) / dims.ep
    exchanges = accum * 2 * (2 + recomputed_blocks(cfg)) * shape.moe_layers / dims.pp
    return exchanges * seconds(nbytes, intra if dims.ep * dims.tp <= gpus_per_node else inter)


def recomputed_blocks(cfg: JobConfig, saved_by_op_ac: bool = False) -> float:
    """Share of the blocks in which AC runs a collective again in backward: all under full AC, one in N under
    every N-th block, and all under op-level AC unless its policy saves that collective's output (it saves
    reduce-scatters, no all-gather or all-to-all: parallel/ac.py)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return 1.0
    if ac.mode == "selective":
        every = every_nth(ac.selective_ac_option)
        if every is None:
            return 0.0 if saved_by_op_ac else 1.0
        return 1 / every
    return 0.0


def cp_seconds(
    cfg: JobConfig,
    dims: ParallelDims,
    shape: Shape,
    accum: int,
    seconds,
    intra: float,
    inter: float,
    gpus_per_node: int,
) -> float:
    """Context parallelism's collectives per step, per layer of this rank's stages: the all-gathers of its keys
    and of its values (forward, and again in AC's recompute) and the reduce-scatters of their gradients
    (backward), each moving the (cp - 1) / cp of the window's keys or values that the other cp ranks hold,
    in the compute dtype; within a node where the cp x tp ranks (adjacent in the mesh) fit in one."""
    if not dims.cp_enabled:
        return 0.0
    training, cp = cfg.training, dims.cp
    window = training.local_batch_size * training.seq_len * shape.kv_width / dims.tp  # keys + values, TP splits heads
    nbytes = window * DTYPES[training.mixed_precision_param].itemsize * (cp - 1) / cp
    passes = accum * (2 + recomputed_blocks(cfg)) * shape.n_layers / dims.pp
    return passes * seconds(nbytes, intra if cp * dims.tp <= gpus_per_node else inter)


def plan_speed(
    cfg: JobConfig,
    gpu: Gpu,
    dims: ParallelDims,
    shape: Shape,
    state_bytes: int,
    intra_gbps: float,
    inter_gbps: float,
    gpus_per_node: int,
) -> Speed:
    """`state_bytes`: this rank's parameters, gradients and optimizer state (the optimizer step reads them)."""
    training = cfg.training
    accum = grad_accumulation_steps(training, dims.dp_degree)
    tokens = training.local_batch_size * training.seq_len * accum / dims.batch_sharing_degree  # per GPU per step
    parts = compute_parts(cfg, gpu, shape, tokens, state_bytes, dims.tp)
    compute = sum(parts.values())

    def seconds(nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e9 * hardware.COLLECTIVE_EFFICIENCY)

    fsdp_forward, fsdp_backward = fsdp_seconds(cfg, dims, shape, accum, seconds, intra_gbps, inter_gbps, gpus_per_node)
    # A TP group wider than a node crosses the fabric at every block (plan_notes says so).
    tp_bytes, tp_sync = tp_seconds(cfg, dims, shape, accum, intra_gbps if dims.tp <= gpus_per_node else inter_gbps)
    ep = ep_seconds(cfg, dims, shape, accum, seconds, intra_gbps, inter_gbps, gpus_per_node)
    cp = cp_seconds(cfg, dims, shape, accum, seconds, intra_gbps, inter_gbps, gpus_per_node)
    hidden = hardware.ASYNC_TP_HIDDEN if cfg.parallelism.enable_async_tensor_parallel else 0.0
    tp = tp_bytes * (1 - hidden) + tp_sync
    compute_bytes = DTYPES[training.mixed_precision_param].itemsize
    across_nodes = (
        dims.dp_degree * dims.cp * dims.tp >= gpus_per_node
    )  # pp is outermost: stage neighbours sit on other nodes
    pp = accum * seconds(
        send_recv_bytes(cfg, dims.pp, dims.tp * dims.cp, shape.dim, compute_bytes),
        inter_gbps if across_nodes else intra_gbps,
    )
    idle = bubble(cfg, dims.pp)
    # FSDP's collectives hide behind the compute of their own pass: the forward's all-gathers behind the forward,
    # the backward's all-gathers and reduce-scatters behind the backward; the optimizer step waits for the last.
    forward = forward_seconds(parts, recompute(cfg))
    backward = compute - parts["optimizer"] - forward
    overlapped = max(forward, fsdp_forward) + max(backward, fsdp_backward) + parts["optimizer"]
    training_s = (overlapped + tp + ep + cp + pp) / (1 - idle)
    # GRPO makes its completions before the step (plan/rollout.py), over the data-parallel link it gathers on;
    # generator ranks, the launch's last, take the weights from trainer 0 over the fabric once the launch spans nodes
    world = dims.dp_degree * dims.batch_sharing_degree
    dp_link = inter_gbps if dims.dp_degree * dims.cp * dims.tp > gpus_per_node else intra_gbps
    launch_link = inter_gbps if world + cfg.rl.generator_ranks > gpus_per_node else intra_gbps
    untimed = forward_seconds(parts, Recompute(0.0, 0.0, 0.0))
    rollout = rollout_seconds(cfg, shape, dims, gpu, dp_link, launch_link, untimed, training_s)
    step = training_s + rollout
    tps = tokens / step
    return Speed(
        compute,
        tuple(parts.items()),
        fsdp_forward + fsdp_backward,
        tp,
        ep,
        cp,
        pp,
        idle,
        step,
        tps,
        100 * tps * shape.flops_per_token / (gpu.bf16_tflops * 1e12),
        tps * world * 86400,
        1e9 / tps / 3600 * (world + cfg.rl.generator_ranks) / world,  # the generators' GPUs too
        rollout,
    )
