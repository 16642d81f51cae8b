"""One optimizer step: forward and backward over the micro-batches (gradient accumulation), then
clipping, the optimizer and the lr schedule."""

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.config_sections import JobConfig
from titanlite.loss import loss_parallel_context, micro_batch_loss, trained_tokens
from titanlite.models.attention import document_ids
from titanlite.parallel.cp import SequenceShard, split_batch
from titanlite.optim import clip_grad_norm_
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.offload import HeldBytes, activation_offload_context


@dataclass(frozen=True)
class StepSettings:
    """What a training step needs to know of the job."""

    accum_steps: int  # micro-batches per optimizer step
    max_norm: float  # training.max_norm: gradient clipping
    aux_loss_coeff: float  # model.moe_aux_loss_coeff: the weight of a model's balance loss
    param_dtype: str  # training.mixed_precision_param: autocast's dtype where FSDP does not cast
    loss_parallel: bool  # TP's vocab-sharded loss (tensor parallelism on, loss parallel not disabled)
    skip_nonfinite: bool = False  # training.on_nonfinite skip: a step with NaN or inf applies no update
    per_trained_token: bool = False  # chat data: the loss is over the trained tokens of the whole global batch
    bias_update_rate: float = 0.0  # model.moe_bias_update_rate: aux-loss-free balancing (balance_experts)

    @classmethod
    def of(cls, cfg: JobConfig, dims: ParallelDims, accum_steps: int) -> "StepSettings":
        return cls(accum_steps, cfg.training.max_norm, cfg.model.moe_aux_loss_coeff, cfg.training.mixed_precision_param,
                   dims.tp_enabled and not cfg.parallelism.disable_loss_parallel, cfg.training.on_nonfinite == "skip",
                   cfg.training.dataset_format != "text", cfg.model.moe_bias_update_rate)


@contextlib.contextmanager
def forward_context(settings: StepSettings, dims: ParallelDims, device_type: str, offloaded: HeldBytes | None):
    """Around every training forward: autocast where FSDP does not cast, and activation offload where
    asked (`offloaded` counts what it holds; None = no offload)."""
    with (mixed_precision_context(dims, settings.param_dtype, device_type),
          activation_offload_context(offloaded)):
        yield


def train_step(model, optimizer, scheduler, batches, settings: StepSettings, dims: ParallelDims, device, metrics, loss_fn,
               pipeline=None, delimiters: tuple[int, int] | None = None, offloaded: HeldBytes | None = None,
               shard: SequenceShard | None = None, replicas=None):
    """One optimizer step over settings.accum_steps micro-batches; returns (loss, grad_norm, lr used, skipped).
    With settings.skip_nonfinite a step whose loss or gradient norm is NaN or inf on any rank is skipped:
    its gradients are dropped and neither the optimizer nor the lr schedule steps (skipped True).
    `delimiters` (bos, eos) split each window into documents for block-causal attention; None = causal.
    `offloaded` counts the activations offloaded to host memory; None = no activation offload.
    `shard`: under context parallelism this rank's positions of every window (parallel/cp.py); None = all.

    Text trains on every token and each micro-batch holds as many (packed windows), so dividing every
    micro-batch mean by accum_steps makes the summed gradient that of the whole batch. Chat data trains
    on some tokens only: each micro-batch mean is weighted by its trained tokens over those of the whole
    global batch (every micro-batch, accumulation step and data-parallel rank), times the data-parallel
    degree that FSDP's gradient average divides by, so the loss and the gradients are those of one
    process holding the whole batch, whatever the layout.
    Under pipeline parallelism the pipeline's schedule runs each micro-batch's forward and backward.
    `replicas` (fault_tolerance.py): the gradients and loss are averaged with the other replica groups before
    clipping, and the update is applied only if the quorum commits the step.
    """
    accum_steps = settings.accum_steps
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    micro_batches = []
    for _ in range(accum_steps):
        inputs, labels = next_batch(batches, device, metrics, dims)
        micro_batches.append(split_batch(inputs, labels, document_ids(inputs, delimiters), shard))
    weights, per_token = trained_token_weights(micro_batches, dims) if settings.per_trained_token else (None, None)
    for index, (inputs, labels, model_kwargs) in enumerate(micro_batches):
        if pipeline is not None:  # the schedule hands every stage its microbatch's document ids
            with forward_context(settings, dims, device.type, offloaded):
                total_loss += pipeline.train_microstep(inputs, labels, accum_steps, settings.aux_loss_coeff,
                                                       model_kwargs, per_token)
            continue
        with loss_parallel_context(settings.loss_parallel):
            loss = micro_batch_loss(model, inputs, labels, model_kwargs, loss_fn,
                                    forward_context(settings, dims, device.type, offloaded))
            loss = loss / accum_steps if weights is None else loss * weights[index]
            aux_loss = getattr(model, "aux_loss", None)  # set by each forward of models with one (MoE balance)
            (loss if aux_loss is None else loss + settings.aux_loss_coeff * aux_loss / accum_steps).backward()
        total_loss += loss.detach()
    if pipeline is not None:
        pipeline.sum_tied_grads()
    if replicas is not None:  # [fault_tolerance]
        replicas.average(model, total_loss)
    grad_norm = clip_grad_norm_(model.parameters(), settings.max_norm, pipeline.group if pipeline else None,
                                uncounted=pipeline.uncounted if pipeline else ())
    lr = scheduler.get_last_lr()[0]
    if settings.skip_nonfinite and not finite_on_every_rank(total_loss, grad_norm):
        optimizer.zero_grad(set_to_none=True)
        balance_experts(model, pipeline, 0.0, device, accum_steps)  # the skipped step's counts are dropped
        return total_loss, grad_norm, lr, True
    if replicas is not None and not replicas.should_commit():  # [fault_tolerance]: nothing applied
        optimizer.zero_grad(set_to_none=True)
        return total_loss, grad_norm, lr, False
    optimizer.step()
    scheduler.step()
    balance_experts(model, pipeline, settings.bias_update_rate, device, accum_steps)
    return total_loss, grad_norm, lr, False


def balance_experts(model, pipeline, rate: float, device, accum_steps: int) -> None:
    """Aux-loss-free balancing, for models whose routers have a bias (DeepSeek-V3): every MoE block's
    tokens per expert in this step, summed over all ranks, move its router's bias by `rate` (the
    model's balance_experts). The sum is the global batch's counts times the TP degree (TP ranks
    route the same tokens; under PP a rank holds only its stages' blocks and adds zeros for the
    others), which leaves each expert's side of the mean, all the update reads, as one process has it."""
    parts = pipeline.parts if pipeline is not None else [model]
    forwards = accum_steps * (pipeline.n_microbatches if pipeline is not None else 1)  # each part's, this step
    if not hasattr(parts[0], "take_step_loads"):
        return
    args = parts[0].args
    loads = torch.zeros(args.n_layers, args.num_experts, dtype=torch.int64, device=device)
    for part in parts:
        for layer_id, load in part.take_step_loads(forwards).items():
            loads[int(layer_id)] += load
    if rate == 0:
        return
    dist.all_reduce(loads)
    for part in parts:
        part.balance_experts(loads, rate)


def next_batch(batches, device, metrics, dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
    waited = time.perf_counter()
    inputs, labels = next(batches)
    metrics.data_seconds += time.perf_counter() - waited
    metrics.tokens += labels.numel() // dims.batch_sharing_degree  # a TP/PP group (and its cp ranks) shares one batch
    return inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def trained_token_weights(micro_batches, dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
    """(each micro-batch's weight, the weight of one trained token): a micro-batch mean times its trained
    tokens is its sum; over the trained tokens of the global batch (counted on every rank, each TP/PP
    group holding one batch; cp ranks count their own shares), times the degree FSDP's gradient average
    divides by (data-parallel x context-parallel ranks)."""
    counts = torch.stack([trained_tokens(labels) for _, labels, _ in micro_batches]).float()
    total = counts.sum().reshape(1)
    dist.all_reduce(total)
    per_token = dims.gradient_average_degree * dims.model_parallel_degree / total
    return counts * per_token, per_token


def finite_on_every_rank(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Whether every rank's loss and the gradient norm (NaN or inf wherever any gradient is) are finite.
    Reading it makes the host wait for the device: the price of deciding before the optimizer step."""
    bad = (~(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach()))).float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()
