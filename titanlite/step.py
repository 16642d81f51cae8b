"""One optimizer step: forward and backward over the micro-batches (gradient accumulation), then
clipping, the optimizer and the lr schedule."""

import contextlib
import dataclasses
import functools
import time

import torch
import torch.distributed as dist

from titanlite.data.batch import MicroBatch
from titanlite.loss import LossScale, loss_parallel_context, per_trained_token, with_extra_losses
from titanlite.models.attention import document_ids
from titanlite.optim import clip_grad_norm_
from titanlite.parallel.cp import split_batch
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.offload import activation_offload_context
from titanlite.run import ForwardSettings, Run, StepSettings, Training


@contextlib.contextmanager
def forward_context(settings: ForwardSettings, dims: ParallelDims, device_type: str):
    """Around every training forward: autocast where FSDP does not cast, and activation offload where asked."""
    with (
        mixed_precision_context(dims, settings.param_dtype, device_type),
        activation_offload_context(settings.offloaded),
    ):
        yield


def train_step(run: Run, training: Training, batches):
    """One optimizer step over run.step.accum_steps micro-batches of `batches`; returns (loss, grad_norm,
    lr used, skipped). With skip_nonfinite a step whose loss or gradient norm is NaN or inf on any rank is
    skipped: its gradients are dropped and neither the optimizer nor the lr schedule steps (skipped True).
    Under fault tolerance (training.replicas, fault_tolerance/) the gradients and loss are averaged with the other
    replica groups before clipping, and the update is applied only if the quorum commits the step.
    Each micro-batch's mean loss enters the step as loss.py's LossScale says, so the loss and the gradients
    are those of one process holding the whole batch, whatever the layout (`run` is build.py's Run).
    Under pipeline parallelism the pipeline's schedule runs each micro-batch's forward and backward.
    """
    settings, dims, device, pipeline, model = run.step, run.dims, run.device, run.pipeline, run.model
    optimizer, scheduler, metrics, replicas = (
        training.optimizer,
        training.scheduler,
        training.metrics,
        training.replicas,
    )
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    micro_batches = [on_device(batch, run) for batch in step_batches(run, batches, metrics)]
    scale = step_loss_scale(micro_batches, settings, dims, pipeline)
    context = functools.partial(forward_context, run.forward, dims, device.type)
    for batch, model_kwargs in micro_batches:
        if pipeline is not None:  # the schedule hands every stage its microbatch's document ids
            with context():
                total_loss += pipeline.train_microstep(
                    batch.inputs, batch.labels, scale, settings.aux_loss_coeff, model_kwargs
                )
            continue
        with loss_parallel_context(run.forward.loss_parallel):
            loss, extra = run.objective.loss(model, batch, model_kwargs, run.loss_fn, context)
            loss = scale.apply(loss, batch.labels)
            with_extra_losses(loss, extra, scale, settings.aux_loss_coeff).backward()
        total_loss += loss.detach()
    if pipeline is not None:
        pipeline.sum_tied_grads()
    loads = expert_loads(model, pipeline, settings.bias_update_rate, device, settings.accum_steps)
    replicas.average(model, total_loss, loads)
    grad_norm = clip_grad_norm_(
        model.parameters(),
        settings.max_norm,
        pipeline.group if pipeline else None,
        uncounted=pipeline.uncounted if pipeline else (),
    )
    lr = scheduler.get_last_lr()[0]
    if settings.skip_nonfinite and not finite_on_every_rank(total_loss, grad_norm):
        optimizer.zero_grad(set_to_none=True)  # the skipped step's expert counts are dropped with it
        return total_loss, grad_norm, lr, True
    if not replicas.should_commit():  # the quorum failed: nothing applied
        optimizer.zero_grad(set_to_none=True)
        return total_loss, grad_norm, lr, False
    optimizer.step()
    scheduler.step()
    if loads is not None:
        for part in pipeline.parts if pipeline is not None else [model]:
            part.balance_experts(loads, settings.bias_update_rate)
    return total_loss, grad_norm, lr, False


def step_loss_scale(micro_batches: list, settings: StepSettings, dims: ParallelDims, pipeline) -> LossScale:
    """How each micro-batch (or a pipeline's microbatch) mean enters this step's loss (loss.py)."""
    means = settings.accum_steps * (pipeline.n_microbatches if pipeline is not None else 1)
    if settings.loss_weighting == "share":  # FSDP's average divides by the data-parallel ranks (GRPO's only layout)
        return LossScale(means, share_degree=dims.gradient_average_degree)
    if settings.loss_weighting == "mean":
        return LossScale(means)
    # FSDP's gradient average divides by the data-parallel x context-parallel ranks; a TP/PP group shares one batch.
    degree = dims.gradient_average_degree * dims.model_parallel_degree
    return LossScale(means, per_trained_token([batch.labels for batch, _ in micro_batches], degree))


def expert_loads(model, pipeline, rate: float, device, accum_steps: int) -> torch.Tensor | None:
    """Aux-loss-free balancing, for models whose routers have a bias (DeepSeek-V3): every MoE block's
    tokens per expert in this step [n_layers, E], summed over all ranks, which the model's
    balance_experts moves its routers' biases by after the optimizer step (None without such routers,
    or at rate 0). The sum is the global batch's counts times the TP degree (TP ranks route the same
    tokens; under PP a rank holds only its stages' blocks and adds zeros for the others), which leaves
    each expert's side of the mean, all the update reads, as one process has it. Every step takes (and
    so forgets) its counts, a skipped or uncommitted step's too."""
    parts = pipeline.parts if pipeline is not None else [model]
    forwards = accum_steps * (pipeline.n_microbatches if pipeline is not None else 1)  # each part's, this step
    if not hasattr(parts[0], "take_step_loads"):
        return None
    args = parts[0].args
    loads = torch.zeros(args.n_layers, args.num_experts, dtype=torch.int64, device=device)
    for part in parts:
        for layer_id, load in part.take_step_loads(forwards).items():
            loads[int(layer_id)] += load
    if rate == 0:
        return None
    dist.all_reduce(loads)
    return loads


def step_batches(run: Run, batches, metrics) -> list[MicroBatch]:
    """The objective's micro-batches of this step, on the host, their tokens counted and (read data's) wait timed;
    generated batches (GRPO's rollouts) time their making themselves (rl/*_seconds), never as the step line's data."""
    waited = time.perf_counter()
    drawn = run.objective.step_batches(batches, run.step.accum_steps)
    if not run.objective.generates:
        metrics.data_seconds += time.perf_counter() - waited
    sharing = run.dims.batch_sharing_degree  # a TP/PP group (and its cp ranks) shares one batch
    for batch in drawn:
        metrics.tokens += batch.labels.numel() // sharing
        metrics.trained += batch.trained_tokens() / sharing
    return drawn


def on_device(batch: MicroBatch, run: Run) -> tuple[MicroBatch, dict]:
    """(the micro-batch on the device, this rank's positions of it under context parallelism, the model's
    keyword arguments: its document ids)."""
    batch = batch.on(run.device, functools.partial(document_ids, delimiters=run.forward.delimiters))
    inputs, labels, model_kwargs = split_batch(batch.inputs, batch.labels, batch.document_ids, run.forward.shard)
    return dataclasses.replace(batch, inputs=inputs, labels=labels), model_kwargs


def finite_on_every_rank(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Whether every rank's loss and the gradient norm (NaN or inf wherever any gradient is) are finite.
    Reading it makes the host wait for the device: the price of deciding before the optimizer step."""
    bad = (~(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach()))).float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()
