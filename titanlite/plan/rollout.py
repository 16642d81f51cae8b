"""GRPO's rollouts in the plan: the memory and time of making a step's completions with the colocated engine
(rl/engine.py), which the trainer spends before the step's forward and backward.

Memory, at the rollout (no gradients are held then: the step has zeroed them): under FSDP the copy of the
whole policy gathered in the compute dtype, under TP its 1 / tp that the rank keeps (the engine gathers FSDP's
dimension only; the norms, replicated, counted as split); the static KV cache of this rank's completions (their
rows x the cache's columns, the prompt and max_new_tokens rounded up to 64, bounded by seq_len + 1, x every layer's
keys and values, as attention receives them, 1 / tp of the heads under TP: an upper bound for DeepSeek's MLA,
whose cache holds its latent whole on every TP rank); the logits of one decode step in fp32, a few copies (the
sampler's log-softmax, the top-k/top-p filters, the probabilities).

Time, per optimizer step (a rollout batch serves rl.num_iterations steps): the gather (the policy's bytes over the
data-parallel link, once); the decode, memory-bound: each of max_new_tokens steps reads the weights and, on average,
half the KV cache (the rank's shares of both under TP) at the measured share of the HBM bandwidth; the old policy's
and the reference's forward passes over the rows (each a third of the step's matmul work). Prefill and scoring are
left out: a prompt's prefill is one forward over a few hundred tokens, and rewards run on the host.

Under rl.generator_ranks N (rl/generator.py) `dims` are the trainers' (the launch's W - N ranks). A trainer holds the
whole policy gathered in the compute dtype (full_copy), and no KV cache or logits: those are the generators'. Its time
per rollout batch is that gather (the whole copy's bytes over the trainers' link), trainer 0's broadcast of it to the
generators (once over `launch_gbps`, the launch's link), the old policy's and the reference's forwards, and the
decode its generator makes of the requests of every trainer it serves (ceil((W - N) / N) of them, one after another,
each a batch of a trainer's rows with the whole copy's weights and KV cache), at the same share of the HBM bandwidth.
At rl.max_staleness 0 the trainer waits for all of that decode; from 1 it overlaps the training of the step before,
so a step waits only for what of the decode (per optimizer step) its training does not hide.
"""

from dataclasses import dataclass

from titanlite.config_sections import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.objectives import objective_class
from titanlite.parallel.dims import ParallelDims
from titanlite.plan import hardware

LOGIT_COPIES = 4  # fp32 [rows, vocab] tensors alive in one decode step's sampling


@dataclass(frozen=True)
class RolloutMemory:
    gathered: int  # bytes of the policy's gathered copy (0 unsharded: the policy decodes as it is)
    kv_cache: int  # bytes of the KV cache of this rank's completions
    logits: int  # bytes of one decode step's logits and their copies

    @property
    def total(self) -> int:
        return self.gathered + self.kv_cache + self.logits


def cache_columns(seq_len: int) -> int:
    """The KV cache's columns at most: the prompt and its completion fit in seq_len + 1, rounded up to 64
    (inference/decode.py's cache_capacity)."""
    return -(-(seq_len + 1) // 64) * 64


def kv_cache_bytes(cfg: JobConfig, shape, rows: int, tp: int) -> int:
    """The static KV cache of `rows` completions decoded together, 1 / tp of its heads under TP."""
    compute = DTYPES[cfg.training.mixed_precision_param].itemsize
    return shape.n_layers * rows * cache_columns(cfg.training.seq_len) * shape.kv_width * compute // tp


def rollout_memory(cfg: JobConfig, shape, dims: ParallelDims) -> RolloutMemory | None:
    """What a GRPO job's rollout holds on each rank (each trainer under generator ranks) besides the training state
    (None for other objectives); `shape` is plan/speed.py's Shape."""
    if not objective_class(cfg).generates:
        return None
    whole = shape.total_params * DTYPES[cfg.training.mixed_precision_param].itemsize
    if cfg.rl.generator_ranks:
        return RolloutMemory(whole, 0, 0)  # full_copy, sent to the generators, which decode
    rows = cfg.training.global_batch_size // dims.dp_degree  # this rank's completions of a rollout batch
    gathered = dims.fsdp_enabled or dims.tp_enabled  # a sharded policy decodes from a copy (TP's shards kept)
    return RolloutMemory(
        whole // dims.tp if gathered else 0,
        kv_cache_bytes(cfg, shape, rows, dims.tp),
        LOGIT_COPIES * rows * shape.vocab * 4,
    )


def decode_seconds(cfg: JobConfig, weights: float, kv_cache: float, gpu) -> float:
    """max_new_tokens memory-bound steps, each reading the weights and, on average, half the KV cache."""
    return cfg.rl.max_new_tokens * (weights + kv_cache / 2) / (gpu.hbm_tbps * 1e12 * hardware.BANDWIDTH)


def rollout_seconds(
    cfg: JobConfig,
    shape,
    dims: ParallelDims,
    gpu,
    link_gbps: float,
    launch_gbps: float,
    forward_seconds: float,
    training_seconds: float,
) -> float:
    """A GRPO job's rollout time per optimizer step (0 for other objectives); `link_gbps` is the data-parallel link,
    `launch_gbps` the link from trainer 0 to the generator ranks, `forward_seconds` one forward pass over the step's
    rows, `training_seconds` the step's forward, backward and optimizer step (what hides a decode ahead)."""
    held = rollout_memory(cfg, shape, dims)
    if held is None:
        return 0.0
    rl = cfg.rl
    efficiency = hardware.COLLECTIVE_EFFICIENCY
    forwards = ((rl.num_iterations > 1) + (rl.beta > 0)) * forward_seconds
    if not rl.generator_ranks:
        weights = shape.total_params * DTYPES[cfg.training.mixed_precision_param].itemsize // dims.tp
        dp = dims.dp_degree
        gather = held.gathered * (dp - 1) / dp / (link_gbps * 1e9 * efficiency)
        return (gather + decode_seconds(cfg, weights, held.kv_cache, gpu) + forwards) / rl.num_iterations
    trainers = dims.dp_degree * dims.batch_sharing_degree
    gather = held.gathered * (trainers - 1) / trainers / (link_gbps * 1e9 * efficiency)
    broadcast = held.gathered / (launch_gbps * 1e9 * efficiency)
    rows = cfg.training.global_batch_size // dims.dp_degree  # a trainer's request
    served = -(-trainers // rl.generator_ranks)  # the most trainers one generator decodes for, one after another
    decode = served * decode_seconds(cfg, held.gathered, kv_cache_bytes(cfg, shape, rows, 1), gpu)
    if rl.max_staleness == 0:
        return (gather + broadcast + forwards + decode) / rl.num_iterations
    return (gather + broadcast + forwards) / rl.num_iterations + max(0.0, decode / rl.num_iterations - training_seconds)
