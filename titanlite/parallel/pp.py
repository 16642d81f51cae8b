"""Pipeline parallelism on torch.distributed.pipelining: split the meta model into stages, run a schedule.

A stage is the whole model's module with only some blocks of `model.layers` kept (the token
embedding on the first stage, the final norm and output on the last; the others set to None, which
the model's forward skips), so parameter names stay the whole model's and DCP checkpoints move
between layouts. Each rank holds `stages_per_rank` stages: stage s of a looped schedule lives on
pp rank s % pp, ZBV's two stages on rank r are r and 2 * pp - 1 - r (a V).
"""

import copy
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config_rules import SINGLE_STAGE_SCHEDULES
from titanlite.config_sections import Parallelism
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.loss import LossScale, computed_in_forward, loss_parallel_context, stage_forward, stage_loss

SCHEDULE_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}


def stages_per_rank(cfg: Parallelism) -> int:
    """-1 takes the schedule's natural count: 1 for single-stage schedules, 2 for the others
    (config_rules refuses the counts a schedule cannot run)."""
    if cfg.pipeline_parallel_stages_per_rank != -1:
        return cfg.pipeline_parallel_stages_per_rank
    return 1 if cfg.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES else 2


def layer_split(n_layers: int, num_stages: int, layers_per_stage: int) -> list[range]:
    """The blocks of each stage; layers_per_stage -1 spreads them evenly, earlier stages taking one more."""
    if num_stages > n_layers:
        raise UserError(
            f"the pipeline has {num_stages} stages (pipeline_parallel_degree x stages per rank) but the model has only "
            f"{n_layers} layers; lower parallelism.pipeline_parallel_degree or pipeline_parallel_stages_per_rank"
        )
    if layers_per_stage == -1:
        sizes = [n_layers // num_stages + (s < n_layers % num_stages) for s in range(num_stages)]
    elif layers_per_stage * num_stages != n_layers:
        raise UserError(
            f"parallelism.pipeline_parallel_layers_per_stage {layers_per_stage} x {num_stages} stages is not the "
            "model's "
            f"{n_layers} layers; set it to -1 (an even split) or to a value whose product with the stages is {n_layers}"
        )
    else:
        sizes = [layers_per_stage] * num_stages
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def microbatches(local_batch_size: int, microbatch_size: int, num_stages: int, schedule: str, pp: int) -> int:
    """Microbatches per micro-step, refused where the schedule cannot run them."""
    if local_batch_size % microbatch_size:
        raise UserError(
            f"parallelism.pipeline_parallel_microbatch_size {microbatch_size} does not divide "
            "training.local_batch_size "
            f"{local_batch_size}; choose a microbatch size that divides it"
        )
    count = local_batch_size // microbatch_size
    if schedule == "1F1B" and count < num_stages:
        raise UserError(
            "parallelism.pipeline_parallel_schedule 1F1B needs at least as many microbatches as stages "
            f"({num_stages}), but "
            f"training.local_batch_size {local_batch_size} / pipeline_parallel_microbatch_size {microbatch_size} = "
            f"{count}; "
            "lower the microbatch size or raise the local batch"
        )
    rounds = max(1, count // pp)  # torch's interleaved schedules run the microbatches in equal rounds
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and count % rounds:
        raise UserError(
            f"parallelism.pipeline_parallel_schedule {schedule} runs its {count} microbatches "
            "(training.local_batch_size "
            f"{local_batch_size} / pipeline_parallel_microbatch_size {microbatch_size}) in {rounds} equal rounds, "
            "which "
            f"they do not fill; choose a local batch giving at most {pp} microbatches or a multiple of {pp}"
        )
    return count


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def keep_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of the meta model holding only this stage's blocks and ends (absent ones are None)."""
    return cut_to_stage(copy.deepcopy(model), layers, first, last)


def cut_to_stage(stage: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """keep_stage in place (the planner's tally cuts its own fake model)."""
    stage.layers = nn.ModuleDict({str(i): stage.layers[str(i)] for i in layers})
    if not first:
        stage.tok_embeddings = None
        if hasattr(stage, "pos_embeddings"):  # GPT-2's learned positions
            stage.pos_embeddings = None
    if not last:
        stage.norm, stage.output = None, None
    return stage


class RankModel(nn.Module):
    """A rank's stages as one module with the whole model's names (optimizer, clipping, checkpoints);
    its forward is never called, the stages are."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = parts  # a plain list: registering them would prefix every name
        self.layers = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == "layers":
                    self.layers.update(child)
                elif child is not None:
                    self.add_module(name, child)

    def train(self, mode: bool = True) -> "RankModel":
        super().train(mode)
        for part in self.parts:
            part.train(mode)  # the parts' own flags (e.g. Mixtral's statistics) follow
        return self


class AuxLossGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also sends `weight` into the stage's aux loss, so
    every stage's MoE balance loss reaches the backward the schedule runs from the output's gradient."""

    @staticmethod
    def forward(ctx, output, aux_loss, weight):
        ctx.weight = weight
        ctx.aux_shape = aux_loss.shape
        # Returned as itself, with this node spliced into its history: no copy of the (possibly
        # vocabulary-wide) output, and not a view, which the zero-bubble schedules' backward detaches in place.
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.full(ctx.aux_shape, ctx.weight, device=grad_output.device), None


@dataclass
class Pipeline:
    """This rank's stages and schedule; each microbatch's loss on the last stage enters the step by `scale`."""

    stages: list  # torch.distributed.pipelining.PipelineStage, one per stage this rank holds
    schedule: object
    group: dist.ProcessGroup
    n_microbatches: int
    loss_parallel: bool
    scale: LossScale = LossScale(1)  # set each micro-step (train_microstep)
    chunked: bool = False  # training.loss_chunk_tokens: the last stage's forward computes the loss
    aux_weight: float = 0.0  # the aux loss coefficient's share per microbatch, set each micro-step
    parts: list[nn.Module] = field(default_factory=list)
    # A tied embedding's copies: the first stage's embedding and the last stage's output weight,
    # which sum their gradients over `tied_group` (this pipeline's first and last ranks; None when
    # one rank holds both).
    tied: list[nn.Parameter] = field(default_factory=list)
    tied_group: dist.ProcessGroup | None = None

    @property
    def has_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def _run(self, run, inputs, labels, model_kwargs) -> torch.Tensor:
        """The summed microbatch losses, known on every rank of the pipeline (the last stage computes them).

        model_kwargs are the model's keyword inputs (e.g. document_ids, [batch, seq]): every rank passes
        them, the schedule splits them into the microbatches and hands each stage's forward its chunk.
        The chunked loss (training.loss_chunk_tokens) runs inside the last stage's forward, so there the
        labels travel the same way, and the schedule's loss_fn receives the loss itself.
        """
        losses = []
        if self.chunked:
            model_kwargs = {**model_kwargs, "labels": labels}
        with loss_parallel_context(self.loss_parallel):
            run(
                *([inputs] if self.has_first else []),
                target=labels if self.has_last else None,
                losses=losses,
                **model_kwargs,
            )
        total = torch.stack(losses).sum().detach() if self.has_last else torch.zeros((), device=labels.device)
        dist.all_reduce(total, group=self.group)  # only the last stage's rank adds a non-zero
        return total

    def train_microstep(
        self, inputs, labels, scale: LossScale, aux_loss_coeff: float, model_kwargs: dict
    ) -> torch.Tensor:
        """Forward and backward of one micro-step's batch; its loss as a run without PP computes it
        (`scale` counts every microbatch of the step: loss.py)."""
        self.scale = scale
        self.aux_weight = scale.aux_weight(aux_loss_coeff)
        return self._run(self.schedule.step, inputs, labels, model_kwargs)

    def eval_loss_sum(self, inputs, labels, model_kwargs: dict) -> torch.Tensor:
        """Forward only: the sum of the token losses of the batch (each microbatch's mean times its trained tokens)."""
        self.scale = LossScale(1, torch.ones((), device=labels.device))
        return self._run(self.schedule.eval, inputs, labels, model_kwargs)

    def sum_tied_grads(self) -> None:
        """After backward, before clipping: every copy of the tied matrix takes the gradient of the
        one matrix (the sum of its embedding and output roles), so all copies take the same step."""
        if not self.tied:
            return
        total = self.tied[0].grad
        for copy_ in self.tied[1:]:  # ZBV's V: one rank holds the first and the last stage
            total = total + copy_.grad
        if self.tied_group is not None:  # the same shard (FSDP, TP) on both ranks: reduce the local tensors
            dist.all_reduce(total.to_local() if hasattr(total, "to_local") else total, group=self.tied_group)
        for i, copy_ in enumerate(self.tied):
            copy_.grad = total if i == 0 else total.clone()  # clipping scales each grad in place

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The tied matrix's last-stage copies: clipped, but left out of the norm (the first stage counts it once)."""
        return self.tied[1:] if self.has_first else self.tied

    def part_forward(self, forward, part: nn.Module, *args, **kwargs) -> torch.Tensor:
        """A stage part's forward: its output alone (what the schedule sends on), with the balance loss its forward
        returned (MoE) spliced into the output's backward, as a share of the whole model's mean."""
        output, extra = forward(*args, extra_losses=True, **kwargs)
        aux_loss = extra.get("moe_aux")
        if aux_loss is None or not torch.is_grad_enabled():
            return output
        share = len(part.layers) / part.args.n_layers  # the part's mean of its blocks -> the model's mean
        return AuxLossGrad.apply(output, aux_loss, self.aux_weight * share)


def check_pipeline(cfg: Parallelism, pp: int, n_layers: int, local_batch_size: int) -> list[range]:
    """Every impossible layout as one sentence, before anything is built; returns the stages' blocks."""
    num_stages = pp * stages_per_rank(cfg)
    microbatches(
        local_batch_size, cfg.pipeline_parallel_microbatch_size, num_stages, cfg.pipeline_parallel_schedule, pp
    )
    return layer_split(n_layers, num_stages, cfg.pipeline_parallel_layers_per_stage)


def stage_parts(
    model: nn.Module, dims, par: Parallelism, local_batch_size: int, parallelize: Callable[[nn.Module], nn.Module]
) -> tuple[list[range], dict[int, nn.Module]]:
    """The pipeline's blocks per stage, and this rank's stages (stage index -> part), parallelized and
    still on the meta device: what the rank will hold (the planner counts these)."""
    splits = check_pipeline(par, dims.pp, model.args.n_layers, local_batch_size)
    ids = stage_ids(dims.mesh["pp"].get_local_rank(), dims.pp, len(splits) // dims.pp, par.pipeline_parallel_schedule)
    last = len(splits) - 1
    return splits, {s: parallelize(keep_stage(model, splits[s], first=s == 0, last=s == last)) for s in ids}


def tie_copies(pipeline: Pipeline, dims, last_pp_rank: int) -> None:
    """Megatron's tied embedding: the first stage's embedding and the last stage's output projection
    are copies of one matrix (initialised alike, from the embedding's key), whose gradients are summed
    over a group of each pipeline's first and last ranks (every rank creates every group)."""
    pipeline.tied = [part.tok_embeddings.weight for part in pipeline.parts if part.tok_embeddings is not None]
    pipeline.tied += [part.output.weight for part in pipeline.parts if part.output is not None]
    if last_pp_rank == 0:  # ZBV's V (or pp 1): the first rank holds both
        return
    ranks = dims.mesh.mesh.reshape(dims.pp, -1)  # pp is the mesh's first dim: column j is pipeline j
    ends = [[int(ranks[0, j]), int(ranks[last_pp_rank, j])] for j in range(ranks.shape[1])]
    pipeline.tied_group, _ = dist.new_subgroups_by_enumeration(ends)


def build_pipeline(
    model: nn.Module,
    dims,
    par: Parallelism,
    local_batch_size: int,
    parallelize: Callable[[nn.Module], nn.Module],
    materialize: Callable[[nn.Module], nn.Module],
    device: torch.device,
    loss_fn,
) -> tuple[nn.Module, Pipeline]:
    """Meta model -> this rank's stage parts, each parallelized, then allocated and initialised by
    `materialize` (build.py's, the same as a model without PP) -> schedule.

    Returns the rank's model (the one part, or a RankModel of several) and its Pipeline.
    """
    # Imported here, not with this module: torch.distributed.pipelining takes most of a second of a
    # process's start-up, which a run without pipeline parallelism does not need.
    from torch.distributed.pipelining import PipelineStage, schedules

    splits, parts = stage_parts(model, dims, par, local_batch_size, parallelize)
    num_stages = len(splits)
    n_micro = microbatches(
        local_batch_size, par.pipeline_parallel_microbatch_size, num_stages, par.pipeline_parallel_schedule, dims.pp
    )
    blocks = " | ".join(f"{split[0]}-{split[-1]}" if len(split) > 1 else f"{split[0]}" for split in splits)
    logger.info(
        f"pipeline: {par.pipeline_parallel_schedule}, {num_stages} stages ({num_stages // dims.pp} per rank) holding "
        f"blocks {blocks}; {n_micro} microbatches of {par.pipeline_parallel_microbatch_size} per micro-step"
    )
    pipeline = Pipeline(
        [],
        None,
        dims.mesh["pp"].get_group(),
        n_micro,
        loss_parallel=dims.tp_enabled and not par.disable_loss_parallel,
        chunked=computed_in_forward(loss_fn),
    )
    for stage_id, part in parts.items():
        forward = functools.partial(pipeline.part_forward, part.forward, part)
        if pipeline.chunked:
            forward = functools.partial(stage_forward, forward, loss_fn if stage_id == num_stages - 1 else None)
        part.forward = forward
        materialize(part)
        pipeline.parts.append(part)
        pipeline.stages.append(PipelineStage(part, stage_id, num_stages, device, group=pipeline.group))
    if getattr(model.args, "tie_embeddings", False):
        per_rank = num_stages // dims.pp
        last_pp_rank = next(
            r
            for r in range(dims.pp)
            if num_stages - 1 in stage_ids(r, dims.pp, per_rank, par.pipeline_parallel_schedule)
        )
        tie_copies(pipeline, dims, last_pp_rank)
    schedule_cls = getattr(schedules, SCHEDULE_CLASSES[par.pipeline_parallel_schedule])
    stages = pipeline.stages[0] if par.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES else pipeline.stages
    # Gradients are not rescaled by the schedule: each microbatch's loss is already scaled (pipeline.scale).
    pipeline.schedule = schedule_cls(
        stages,
        n_microbatches=n_micro,
        scale_grads=False,
        loss_fn=lambda output, labels: pipeline.scale.apply(stage_loss(output, labels, loss_fn), labels),
    )
    rank_model = pipeline.parts[0] if len(pipeline.parts) == 1 else RankModel(pipeline.parts)
    return rank_model, pipeline
