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


def rollout_memory(cfg: JobConfig, shape, dims: ParallelDims) -> RolloutMemory | None:
    """What a GRPO job's rollout holds on each rank besides the training state (None for other objectives);
    `shape` is plan/speed.py's Shape."""
    if not objective_class(cfg).generates:
        return None
    compute = DTYPES[cfg.training.mixed_precision_param].itemsize
    rows = cfg.training.global_batch_size // dims.dp_degree  # this rank's completions of a rollout batch
    kv_cache = shape.n_layers * rows * cache_columns(cfg.training.seq_len) * shape.kv_width * compute // dims.tp
    gathered = dims.fsdp_enabled or dims.tp_enabled  # a sharded policy decodes from a copy (TP's shards kept)
    return RolloutMemory(
        shape.total_params * compute // dims.tp if gathered else 0, kv_cache, LOGIT_COPIES * rows * shape.vocab * 4
    )


def rollout_seconds(cfg: JobConfig, shape, dims: ParallelDims, gpu, link_gbps: float, forward_seconds: float) -> float:
    """A GRPO job's rollout time per optimizer step (0 for other objectives); `forward_seconds` is one forward pass
    over the step's rows, `link_gbps` the data-parallel link."""
    held = rollout_memory(cfg, shape, dims)
    if held is None:
        return 0.0
    rl = cfg.rl
    weights = shape.total_params * DTYPES[cfg.training.mixed_precision_param].itemsize // dims.tp
    dp = dims.dp_degree
    gather = held.gathered * (dp - 1) / dp / (link_gbps * 1e9 * hardware.COLLECTIVE_EFFICIENCY)
    decode = rl.max_new_tokens * (weights + held.kv_cache / 2) / (gpu.hbm_tbps * 1e12 * hardware.BANDWIDTH)
    forwards = (rl.num_iterations > 1) + (rl.beta > 0)
    return (gather + decode + forwards * forward_seconds) / rl.num_iterations
