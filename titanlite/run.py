"""The two objects a job is built into (build.py), which every consumer takes instead of loose values:

- `Run`, frozen: how the model computes: this process, the mesh, the model (its parts and pipeline), the forward's
  and the step's settings, the objective, and the model's size and FLOPs;
- `Training`: what moves while it trains: the optimizer, the lr schedule, the data loader, the train state, the
  metrics and the other replica groups, with the number of steps settled before anyone reads it.

This module sits low in the import order (it imports no builder), so the step, the checkpoint manager, validation and
the evaluators can all name these types.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from titanlite.config_sections import JobConfig, Model
from titanlite.parallel.cp import SequenceShard
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.dist import DistInfo
from titanlite.parallel.offload import HeldBytes


@dataclass(frozen=True)
class StepSettings:
    """What a training step needs to know of the job, besides its forward (ForwardSettings)."""

    accum_steps: int  # micro-batches per optimizer step
    max_norm: float  # training.max_norm: gradient clipping
    aux_loss_coeff: float  # model.moe_aux_loss_coeff: the weight of a model's balance loss
    skip_nonfinite: bool = False  # training.on_nonfinite skip: a step with NaN or inf applies no update
    # The objective's: how a micro-batch's loss enters the step's (loss.py's LossScale): "mean" (an equal part),
    # "trained_token" (the loss is over the trained tokens of the whole global batch) or "share" (loss() gives the
    # micro-batch's share of the global batch's loss itself).
    loss_weighting: str = "mean"
    bias_update_rate: float = 0.0  # model.moe_bias_update_rate: aux-loss-free balancing (balance_experts)


@dataclass(frozen=True)
class ForwardSettings:
    """What every training forward runs under, and how its batch is split."""

    param_dtype: str  # training.mixed_precision_param: autocast's dtype where FSDP does not cast
    loss_parallel: bool  # TP's vocab-sharded loss (tensor parallelism on, loss parallel not disabled)
    delimiters: tuple[int, int] | None = None  # (bos, eos) split windows into documents (block-causal); None = causal
    shard: SequenceShard | None = None  # context parallelism: this rank's positions of every window; None = all
    offloaded: HeldBytes | None = None  # activation offload: what it holds in host memory; None = no offload


def model_label(cfg: Model) -> str:
    """The model as logs, errors and checkpoints name it; a depth override is part of the name."""
    label = f"{cfg.name}/{cfg.flavor}"
    return f"{label} with model.n_layers {cfg.n_layers}" if cfg.n_layers else label


@dataclass(frozen=True)
class Run:
    """Everything a job builds before its loop, once: the trainer's step, validation, the checkpoint manager, the
    planner's start-up prediction and the in-loop evaluator read it from here."""

    cfg: JobConfig  # as loaded: nothing changes it after the build
    info: DistInfo  # this process: rank, world size, device
    dims: ParallelDims  # the mesh and its degrees
    spec: object  # the model family (models.ModelSpec)
    args: object  # the family's model args (flavor or HF folder, vocab and depth resolved)
    tokenizer: object
    model: nn.Module  # this rank's model: sharded as the layout says; under PP its stage(s)
    pipeline: object  # parallel/pp.py's Pipeline; None without pipeline parallelism
    loss_fn: Callable
    forward: ForwardSettings
    step: StepSettings
    num_params: int  # the whole model's
    flops_per_token: float  # training FLOPs per token (metrics.py's MFU)
    objective: object  # objectives/: its loss, rows per example, reference model and scalars

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def label(self) -> str:
        return model_label(self.cfg.model)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all data-parallel ranks."""
        training = self.cfg.training
        rows = training.local_batch_size * self.objective.rows_per_example
        return rows * training.seq_len * self.dims.dp_degree * self.step.accum_steps


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # over all data-parallel ranks


@dataclass
class Training:
    """What moves while the run trains, built once after the Run (build.py's build_training)."""

    optimizer: torch.optim.Optimizer
    scheduler: object  # the lr schedule (optim.build_lr_scheduler)
    dataloader: object  # the stateful data loader: its position is checkpoint state
    steps: int  # training.steps, or what training.epochs comes to: settled here, read by everyone after
    metrics: object  # metrics.MetricsLogger
    replicas: object  # fault tolerance's other replica groups (a job alone: every call a no-op)
    state: TrainState = field(default_factory=TrainState)  # the step and tokens seen; a resume restores it in place
