"""What a pipeline adds to the plan: each pp rank's stages (counted from pp.stage_parts, the
trainer's own split), the activations of the microbatches it holds at once, the schedule's bubble
and the activations sent between stages.

Microbatches in flight (activations kept until their backward), per pp rank r of pp:
GPipe runs every forward first, so all microbatches; 1F1B starts the backwards after pp - r
forwards, so min(microbatches, pp - r); the multi-stage schedules (interleaved, zero-bubble)
follow torch's Interleaved1F1B warm-up, (v - 1) x pp + 2 x (pp - 1 - r) + 1 stage-microbatches
for v stages per rank, at most v x microbatches. Each in-flight stage-microbatch is counted at
the rank's largest stage (an upper bound where stages differ by a block); the logits and loss are
counted for the last stage's microbatches in flight (last_stage_in_flight).
"""

from dataclasses import dataclass

from titanlite.config_sections import JobConfig
from titanlite.parallel.pp import microbatches, stages_per_rank
from titanlite.plan.activations import Activations

# Zero-bubble schedules split each backward into input (B) and weight (W) gradients and fill the
# warm-up/cool-down gaps with W: ZB-H1's bubble is (pp - 1)(F + B - W) against 1F1B's (pp - 1)(F + B + W)
# (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), a third of it for equal F, B and W times.
ZERO_BUBBLE_SHARE = 1 / 3


@dataclass(frozen=True)
class Stages:
    """One pp rank's stages."""

    pp_rank: int
    ids: list[int]  # stage indices (of pp x stages per rank)
    blocks: int  # blocks of its largest stage
    held: int  # blocks of all its stages
    first: bool  # holds the token embedding
    last: bool  # holds the final norm, output, logits and loss

    @property
    def name(self) -> str:
        ends = [end for end, held in (("embedding", self.first), ("output + loss", self.last)) if held]
        stages = ", ".join(map(str, self.ids))
        return f"pp rank {self.pp_rank} (stage{'s' * (len(self.ids) > 1)} {stages}{''.join(f'; {e}' for e in ends)})"


def microbatch_count(cfg: JobConfig, pp: int) -> int:
    par = cfg.parallelism
    return microbatches(
        cfg.training.local_batch_size,
        par.pipeline_parallel_microbatch_size,
        pp * stages_per_rank(par),
        par.pipeline_parallel_schedule,
        pp,
    )


def in_flight(cfg: JobConfig, pp: int, pp_rank: int) -> int:
    """Stage-microbatches whose activations the rank holds at once (the module docstring's model)."""
    count, schedule, per_rank = (
        microbatch_count(cfg, pp),
        cfg.parallelism.pipeline_parallel_schedule,
        stages_per_rank(cfg.parallelism),
    )
    if schedule == "GPipe":
        return count
    if schedule == "1F1B":
        return min(count, pp - pp_rank)
    return min(per_rank * count, (per_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def stage_activations(
    block: Activations, ends: Activations, transient: int, stages: Stages, held: int, ends_held: int
) -> Activations:
    """`held` stage-microbatches of `block` x the largest stage's blocks, one of them at its backward's peak,
    and on the rank that holds the last stage `ends_held` microbatches' `ends` (logits, loss). Above what is
    saved, the backward's peak: the ends' (the loss's, or one block's recompute) on the last stage, elsewhere
    `transient`, one block's recompute and gradients as a stage without the loss holds them."""
    saved = held * stages.blocks * block.saved + stages.last * ends_held * ends.saved
    peak = saved + stages.blocks * (block.peak - block.saved) + (ends.peak - ends.saved if stages.last else transient)
    return Activations(int(saved), int(peak))


def last_stage_in_flight(cfg: JobConfig, pp: int) -> int:
    """Microbatches whose logits the last stage holds at once: all under GPipe; one otherwise, as every
    other schedule runs the last stage's backward right after its forward."""
    return microbatch_count(cfg, pp) if cfg.parallelism.pipeline_parallel_schedule == "GPipe" else 1


def bubble(cfg: JobConfig, pp: int) -> float:
    """Idle share of the step. The warm-up and cool-down take (pp - 1) stage-times of one microbatch, a
    stage being 1/v of a rank's layers for v stages per rank, beside the microbatches' own time:
    ((pp - 1) / v) / (microbatches + (pp - 1) / v) (Narayanan et al. 2021, "Efficient Large-Scale Language
    Model Training on GPU Clusters", section 2.2: GPipe and 1F1B at v = 1), a third of that for the
    zero-bubble schedules (ZERO_BUBBLE_SHARE)."""
    if pp == 1:
        return 0.0
    count, schedule = microbatch_count(cfg, pp), cfg.parallelism.pipeline_parallel_schedule
    warmup = (pp - 1) / stages_per_rank(cfg.parallelism)
    share = warmup / (count + warmup)
    return share * ZERO_BUBBLE_SHARE if "ZeroBubble" in schedule else share


def send_recv_bytes(cfg: JobConfig, pp: int, split: int, dim: int, compute_bytes: int) -> int:
    """Bytes one pp rank sends per micro-step: each stage's output activations forward and the gradient of
    its input backward, per microbatch, split over `split` ranks (tp x cp: the blocks' outputs are
    sequence-parallel shards of the rank's share of the window)."""
    if pp == 1:
        return 0
    par, training = cfg.parallelism, cfg.training
    microbatch = par.pipeline_parallel_microbatch_size * training.seq_len * dim * compute_bytes // split
    return 2 * stages_per_rank(par) * microbatch_count(cfg, pp) * microbatch
