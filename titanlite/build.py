"""The build path the trainer, the planner, the generator and the evaluator share: a job's model args (from
its flavor or an HF folder), the model on the meta device, how it is parallelized, the accumulation steps,
and `build_run`, which builds all of it once into a frozen `Run`. Whatever the trainer builds, the planner
counts, because both call these functions."""

import dataclasses
import functools

import torch
from torch import nn

from titanlite.config_rules import check_context_parallel
from titanlite.config_sections import JobConfig, LoRA
from titanlite.config_sections import Training as TrainingSection
from titanlite.data.global_order import steps_for_epochs
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.fault_tolerance import replica_groups
from titanlite.loss import build_loss
from titanlite.metrics import MetricsLogger
from titanlite.metrics.validation import check_validation
from titanlite.models import get_model_spec
from titanlite.models.attention import document_delimiters
from titanlite.models.construct import materialize, meta_model, model_args, parallelizer, seed_everything
from titanlite.objectives import build_objective, objective_class
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.cp import sequence_shard
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.dist import DistInfo
from titanlite.parallel.ep import EXPERT_WEIGHTS, is_moe
from titanlite.parallel.float8 import register_float8_scale_precompute
from titanlite.parallel.offload import HeldBytes, note_if_offload_saves_nothing, optimizer_device_type
from titanlite.parallel.parallelize import ParallelizeSettings
from titanlite.parallel.pp import build_pipeline
from titanlite.run import ForwardSettings, Run, StepSettings, Training, model_label


def build_run(cfg: JobConfig, info: DistInfo) -> Run:
    """config -> mesh -> tokenizer -> model args -> the model, parallelized, allocated and initialised
    (weights are loaded afterwards, by the checkpoint manager) -> the objective -> the step's and forward's settings."""
    dims = ParallelDims.from_config(cfg.parallelism, info.world_size)  # degrees the world cannot hold: said first
    check_context_parallel(cfg.training.seq_len, dims.cp)
    dims.build_mesh(info.device.type)
    seed_everything(cfg.job.seed, cfg.training.deterministic)
    tokenizer = build_tokenizer(cfg.model)
    spec = get_model_spec(cfg.model.name)
    args = resolve_model_args(cfg, spec, tokenizer.vocab_size)
    if cfg.validation.enable:
        check_validation(cfg.validation, cfg.training, args.max_seq_len)
    loss_fn = build_loss(cfg.training, cfg.compile)
    model, num_params, flops_per_token, pipeline = build_model(cfg, spec, args, dims, info.device, loss_fn)
    note_if_offload_saves_nothing(cfg.activation_checkpoint.offload_activations, info.device.type)
    # a reference model is built and sharded like the policy, without adapters
    copy = functools.partial(build_model, dataclasses.replace(cfg, lora=LoRA()), spec, args, dims, info.device, loss_fn)
    objective = build_objective(cfg, lambda: copy()[0], spec.hf_adapter, args, model_label(cfg.model), info.device)
    accum_steps = grad_accumulation_steps(cfg.training, dims.dp_degree)
    return Run(
        cfg,
        info,
        dims,
        spec,
        args,
        tokenizer,
        model,
        pipeline,
        loss_fn,
        forward_settings(cfg, dims, info.device, tokenizer),
        step_settings(cfg, accum_steps, objective),
        num_params,
        flops_per_token,
        objective,
    )


def forward_settings(cfg: JobConfig, dims: ParallelDims, device: torch.device, tokenizer) -> ForwardSettings:
    offload = cfg.activation_checkpoint.offload_activations
    return ForwardSettings(
        cfg.training.mixed_precision_param,
        dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
        document_delimiters(cfg.model.attention_mask, tokenizer, cfg.training.dataset)
        if objective_class(cfg).rows_may_pack
        else None,
        sequence_shard(cfg.training.seq_len, dims.cp_mesh, device) if dims.cp_enabled else None,
        HeldBytes() if offload else None,
    )


def step_settings(cfg: JobConfig, accum_steps: int, objective) -> StepSettings:
    return StepSettings(
        accum_steps,
        cfg.training.max_norm,
        cfg.model.moe_aux_loss_coeff,
        cfg.training.on_nonfinite == "skip",
        objective.loss_weighting,
        cfg.model.moe_bias_update_rate,
    )


def build_training(run: Run) -> Training:
    """What moves while the run trains: the optimizer, the lr schedule over the settled number of steps, the data
    loader (under fault tolerance this replica group's share of the global order), the metrics and the replica
    groups."""
    cfg, info = run.cfg, run.info
    replicas = replica_groups(
        cfg.fault_tolerance
    )  # met after the checkpoint's load (train.py), every rule checked first
    optimizer = build_optimizer(
        run.model, cfg.optimizer, optimizer_device_type(cfg.parallelism.fsdp_cpu_offload, info.device.type)
    )
    register_float8_scale_precompute(optimizer, run.model, cfg.float8)
    dataloader = run.objective.dataloader(run, replicas.data_rank(run.dims), replicas.data_world(run.dims))
    steps = cfg.training.steps
    if cfg.training.epochs:  # the steps every reader (schedule, loop, evaluation) then sees
        steps = steps_for_epochs(cfg.training.epochs, dataloader, run.step.accum_steps, steps)
    return Training(
        optimizer,
        build_lr_scheduler(optimizer, cfg.lr_scheduler, steps),
        dataloader,
        steps,
        MetricsLogger(cfg.metrics, info.rank, info.device, run.flops_per_token),
        replicas,
    )


def resolve_model_args(cfg: JobConfig, spec, tokenizer_vocab: int):
    """The training job's model args (model_args), with model.reset_position_ids always on for chat data (each
    conversation starts at position 0, as at inference) and training.seq_len checked against the model's context."""
    reset = cfg.model.reset_position_ids or objective_class(cfg).resets_positions
    args = dataclasses.replace(model_args(cfg.model, spec, tokenizer_vocab), reset_position_ids=reset)
    if cfg.training.seq_len > args.max_seq_len:
        raise UserError(
            f"training.seq_len {cfg.training.seq_len} exceeds the context of {model_label(cfg.model)} "
            f"({args.max_seq_len}); lower training.seq_len"
        )
    return args


def grad_accumulation_steps(cfg: TrainingSection, dp_degree: int) -> int:
    """Micro-steps per optimizer step so that local x dp x micro-steps = global batch."""
    per_micro_step = cfg.local_batch_size * dp_degree
    if cfg.global_batch_size == -1:
        return 1
    if cfg.global_batch_size < per_micro_step or cfg.global_batch_size % per_micro_step:
        raise UserError(
            f"training.global_batch_size {cfg.global_batch_size} must be a multiple of local_batch_size "
            f"{cfg.local_batch_size} x data-parallel degree {dp_degree} = {per_micro_step}"
        )
    return cfg.global_batch_size // per_micro_step


def model_flops_per_token(spec, model: nn.Module, seq_len: int) -> float:
    """The family's training FLOPs per token, less what frozen weights (LoRA's base) do not cost: their
    gradient, 2 FLOPs per weight and token, is never computed. The token embedding is a lookup, never counted.
    A token uses top_k of an MoE block's routed experts, as the family counts them: so much of theirs is saved."""
    used = {
        id(w): w.numel() // moe.num_experts * moe.top_k
        for moe in model.modules()
        if is_moe(moe)
        for w in (getattr(moe, name) for name in EXPERT_WEIGHTS)
    }
    # every name of a tied matrix: as the output projection it is a matmul, as the embedding a lookup
    frozen = [
        used.get(id(p), p.numel())
        for name, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad and p.dim() == 2 and "tok_embeddings" not in name
    ]
    return spec.flops_per_token(model, seq_len) - 2.0 * sum(frozen)


def build_model(cfg: JobConfig, spec, args, dims: ParallelDims, device: torch.device, loss_fn):
    """Meta-device model -> (this rank's pipeline stages) -> parallelize -> allocate only this rank's
    shards -> initialise them. Returns the model, its size and FLOPs, and the Pipeline (None without PP)."""
    model = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    num_params = model.num_params()
    flops_per_token = model_flops_per_token(spec, model, cfg.training.seq_len)
    parallelize = parallelizer(spec, dims, ParallelizeSettings.of(cfg))
    allocate = functools.partial(materialize, seed=cfg.job.seed, device=device, tp_enabled=dims.tp_enabled)
    if dims.pp_enabled:
        model, pipeline = build_pipeline(
            model, dims, cfg.parallelism, cfg.training.local_batch_size, parallelize, allocate, device, loss_fn
        )
        return model, num_params, flops_per_token, pipeline
    return allocate(parallelize(model)), num_params, flops_per_token, None
