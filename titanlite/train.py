"""Entry point: python -m titanlite.train --job.config_file X.toml [--section.key value ...]

Reads top to bottom in the order a job happens: config -> mesh -> model -> optimizer -> data ->
loop -> close. Each component comes from one build_* call; this file owns only the loop.
"""

import contextlib
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.checkpoint import CheckpointManager, StopFlags
from titanlite.checkpoint.cost import SaveCost
from titanlite.config import load_config, write_resolved_config
from titanlite.config_sections import Compile, JobConfig, Model, Training
from titanlite.data.datasets import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.log import init_logger, logger
from titanlite.metrics import MetricsLogger, log_tokens_by_source, source_scalars
from titanlite.models.attention import document_delimiters, document_ids
from titanlite.models import get_model_args, get_model_spec
from titanlite.models.output_loss import ChunkedCrossEntropy, chunk_loss, micro_batch_loss
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titanlite.output_folders import check_output_folders
from titanlite.parallel import mixed_precision_context
from titanlite.parallel.compile import maybe_compile_loss
from titanlite.parallel.float8 import register_float8_scale_precompute
from titanlite.parallel.fsdp import DTYPES
from titanlite.parallel.offload import HeldBytes, activation_offload_context, note_if_offload_saves_nothing, optimizer_device_type
from titanlite.parallel.pp import build_pipeline
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import local_loss, loss_parallel_context, place_grads_like_params
from titanlite.parallel.dist import DistInfo, close_distributed, init_distributed
from titanlite.profiling import RunSummary, StepProfiler
from titanlite.tensorboard import hyperparameters
from titanlite.validation import Validator, check_validation


def grad_accumulation_steps(cfg: Training, dp_degree: int) -> int:
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


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def model_label(cfg: Model) -> str:
    """The model as logs, errors and checkpoints name it; a depth override is part of the name."""
    label = f"{cfg.name}/{cfg.flavor}"
    return f"{label} with model.n_layers {cfg.n_layers}" if cfg.n_layers else label


def resolve_model_args(cfg: JobConfig, spec, tokenizer_vocab: int):
    """The flavor's args with the vocab taken from the tokenizer where the flavor leaves it open,
    model.n_layers blocks where it is set, and model.reset_position_ids."""
    args = dataclasses.replace(get_model_args(spec, cfg.model.flavor), reset_position_ids=cfg.model.reset_position_ids)
    if cfg.model.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    where = model_label(cfg.model)
    if args.vocab_size == -1:
        args = dataclasses.replace(args, vocab_size=tokenizer_vocab)
    elif args.vocab_size < tokenizer_vocab:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab} tokens but {where} has a vocabulary of {args.vocab_size}; "
            "use that model's own tokenizer (model.tokenizer_path) or a debugmodel flavor"
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise UserError(
            f"training.seq_len {cfg.training.seq_len} exceeds the context of {where} ({args.max_seq_len}); lower training.seq_len"
        )
    return args


def build_model(cfg: JobConfig, spec, args, dims: ParallelDims, device: torch.device, loss_fn=None):
    """Meta-device model -> (this rank's pipeline stages) -> parallelize -> allocate only this rank's
    shards -> initialise them. Returns the model, its size and FLOPs, and the Pipeline (None without PP)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to(dtype=DTYPES[cfg.training.param_dtype])  # init_weights keeps the RoPE tables in fp32
    num_params = model.num_params()
    flops_per_token = spec.flops_per_token(model, cfg.training.seq_len)
    if dims.pp_enabled:
        model, pipeline = build_pipeline(model, dims, cfg, spec.parallelize, device, loss_fn or cross_entropy_loss)
        return model, num_params, flops_per_token, pipeline
    model = spec.parallelize(model, dims, cfg)
    model.to_empty(device=device)
    if dims.tp_enabled:
        place_grads_like_params(model)
    model.init_weights(seed=cfg.job.seed)
    model.train()
    return model, num_params, flops_per_token, None


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_loss(cfg: Training, compile_cfg: Compile):
    """cross_entropy_loss of the logits, or with training.loss_chunk_tokens the chunked output projection +
    loss that the model's forward runs (models/output_loss.py); compiled where compile.components has "loss"
    (the chunked one per chunk: its loop stays eager)."""
    if cfg.loss_chunk_tokens:
        return ChunkedCrossEntropy(cfg.loss_chunk_tokens, maybe_compile_loss(chunk_loss, compile_cfg))
    return maybe_compile_loss(cross_entropy_loss, compile_cfg)


@contextlib.contextmanager
def forward_context(cfg: JobConfig, dims, device_type: str, offloaded: HeldBytes | None):
    """Around every training forward: autocast where FSDP does not cast, and activation offload where
    asked (`offloaded` counts what it holds; None = no offload)."""
    with (mixed_precision_context(dims, cfg.training.mixed_precision_param, device_type),
          activation_offload_context(offloaded)):
        yield


def train_step(model, optimizer, scheduler, batches, accum_steps: int, cfg: JobConfig, dims, device, metrics, loss_fn,
               pipeline=None, delimiters: tuple[int, int] | None = None, offloaded: HeldBytes | None = None):
    """One optimizer step over accum_steps micro-batches; returns (loss, grad_norm, lr used).
    `delimiters` (bos, eos) split each window into documents for block-causal attention; None = causal.
    `offloaded` counts the activations offloaded to host memory; None = no activation offload.

    Each micro-batch holds the same number of tokens (packed windows), so dividing every
    micro-batch mean by accum_steps makes the summed gradient that of the whole batch.
    Under pipeline parallelism the pipeline's schedule runs each micro-batch's forward and backward.
    """
    optimizer.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=device)
    for _ in range(accum_steps):
        waited = time.perf_counter()
        inputs, labels = next(batches)
        metrics.data_seconds += time.perf_counter() - waited
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        metrics.tokens += labels.numel() // dims.model_parallel_degree  # a TP/PP group shares one batch
        ids = document_ids(inputs, delimiters)
        if pipeline is not None:  # the schedule hands every stage its microbatch's document ids
            with forward_context(cfg, dims, device.type, offloaded):
                total_loss += pipeline.train_microstep(inputs, labels, accum_steps, cfg.model.moe_aux_loss_coeff,
                                                       {} if ids is None else {"document_ids": ids})
            continue
        with loss_parallel_context(dims.tp_enabled and not cfg.parallelism.disable_loss_parallel):
            loss = micro_batch_loss(model, inputs, labels, ids, loss_fn, forward_context(cfg, dims, device.type, offloaded))
            loss = local_loss(loss) / accum_steps
            aux_loss = getattr(model, "aux_loss", None)  # set by each forward of models with one (MoE balance)
            (loss if aux_loss is None else loss + cfg.model.moe_aux_loss_coeff * aux_loss / accum_steps).backward()
        total_loss += loss.detach()
    if pipeline is not None:
        pipeline.sum_tied_grads()
    grad_norm = clip_grad_norm_(model.parameters(), cfg.training.max_norm, pipeline.group if pipeline else None,
                                uncounted=pipeline.uncounted if pipeline else ())
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return total_loss, grad_norm, lr


def speed_settings(cfg: JobConfig) -> dict[str, str]:
    """Activation checkpointing, compile, float8 and loss chunks as the run uses them (start-up line, TensorBoard hparams)."""
    ac = cfg.activation_checkpoint
    ac_text = f"selective ({ac.selective_ac_option})" if ac.mode == "selective" else ac.mode
    compile_text = ",".join(cfg.compile.components) if cfg.compile.enable else "off"
    float8_text = cfg.float8.recipe_name if cfg.float8.enable else "off"
    chunks_text = f"{cfg.training.loss_chunk_tokens} tokens" if cfg.training.loss_chunk_tokens else "off"
    return {"AC": ac_text, "compile": compile_text, "float8": float8_text, "loss chunks": chunks_text}


def speed_features(cfg: JobConfig) -> str:
    return " | ".join(f"{name} {value}" for name, value in speed_settings(cfg).items())


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)  # gloo has no AVG; sum and divide
    return value.item() / dist.get_world_size()


def model_metrics(model) -> dict[str, float] | None:
    """What a model reports about itself since the last log (e.g. MoE expert load), averaged over ranks."""
    values = model.extra_metrics() if hasattr(model, "extra_metrics") else {}
    if not values:
        return None
    stacked = torch.stack([v.float() for v in values.values()])
    dist.all_reduce(stacked)
    return dict(zip(values, (stacked / dist.get_world_size()).tolist()))


def nothing_to_train(stop: StopFlags, step: int, steps: int) -> bool:
    """A stop signal during the load, or a resume at or past the last step: exit 0 untrained."""
    if stop.signalled_anywhere():
        logger.info(f"{stop.signal} came while loading; exiting at step {step} without training (nothing new to save)")
        return True
    if step >= steps:
        logger.info(f"resumed at step {step}, which is at or past training.steps {steps}: nothing to train; raise training.steps to train further")
        return True
    return False


def predict_on_gpu(cfg: JobConfig, spec, args, dims, model, info: DistInfo):
    """The planner's memory and tps for this run, logged at start, on CUDA only: the activation tally
    of a CPU debug run would cost it about a second of start-up for a figure nobody needs there."""
    if info.device.type != "cuda":
        return None
    from titanlite.plan.fake_world import state_bytes
    from titanlite.plan.job import predict

    pp_rank = dims.mesh["pp"].get_local_rank() if dims.pp_enabled else 0
    planned = predict(cfg, spec, args, dims, {pp_rank: state_bytes(model, cfg.optimizer.name)})
    logger.info(f"plan on {cfg.plan.gpu}: predicted peak memory {planned.memory.peak / 2**30:.2f}GiB "
                f"({100 * planned.memory.share:.0f}% of the GPU with margin), {planned.speed.tps:,.0f} tps per GPU")
    return planned


def train(cfg: JobConfig, info: DistInfo) -> None:
    check_output_folders(cfg)  # before anything is written: a bad path stops the run now, not at the first save
    init_logger(info.rank, Path(cfg.job.dump_folder) / "logs" if cfg.job.log_rank_files else None)
    if info.allocator_note:
        logger.info(info.allocator_note)
    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, info.rank, info.device)  # memory history from here on
    dims = ParallelDims.from_config(cfg.parallelism, info.world_size)
    dims.build_mesh(info.device.type)
    seed_everything(cfg.job.seed, cfg.training.deterministic)
    if info.rank == 0:
        write_resolved_config(cfg, Path(cfg.job.dump_folder))

    tokenizer = build_tokenizer(cfg.model)
    spec = get_model_spec(cfg.model.name)
    args = resolve_model_args(cfg, spec, tokenizer.vocab_size)
    if cfg.validation.enable:
        check_validation(cfg.validation, cfg.training, args.max_seq_len)
    loss_fn = build_loss(cfg.training, cfg.compile)
    model, num_params, flops_per_token, pipeline = build_model(cfg, spec, args, dims, info.device, loss_fn)
    optimizer = build_optimizer(model, cfg.optimizer, optimizer_device_type(cfg.parallelism.fsdp_cpu_offload, info.device.type))
    register_float8_scale_precompute(optimizer, model, cfg.float8)
    note_if_offload_saves_nothing(cfg.activation_checkpoint.offload_activations, info.device.type)
    offloaded = HeldBytes() if cfg.activation_checkpoint.offload_activations else None
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    accum_steps = grad_accumulation_steps(cfg.training, dims.dp_degree)
    delimiters = document_delimiters(cfg.model.attention_mask, tokenizer, cfg.training.dataset)
    training = cfg.training
    dataloader = build_dataloader(
        dataset=training.dataset, dataset_path=training.dataset_path, text_field=training.dataset_text_field,
        tokenizer=tokenizer, seq_len=training.seq_len, batch_size=training.local_batch_size,
        dp_rank=dims.dp_rank, dp_world=dims.dp_degree, seed=cfg.job.seed, num_workers=training.num_workers,
        dataset_mix=training.dataset_mix,
    )
    metrics = MetricsLogger(cfg.metrics, info.rank, info.device, flops_per_token)
    tokens_per_step = training.local_batch_size * training.seq_len * dims.dp_degree * accum_steps
    if cfg.job.description:
        logger.info(f"job: {cfg.job.description}")
    data = f"a mix of {len(training.dataset_mix)} sources" if training.dataset_mix else training.dataset_path or training.dataset
    mesh = f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x tp {dims.tp}, pp {dims.pp}"
    logger.info(
        f"model {model_label(cfg.model)}: {num_params:,} parameters, vocab {args.vocab_size} | "
        f"world {info.world_size} on {info.device.type}, mesh {mesh} | "
        f"dtype {training.mixed_precision_param} | {speed_features(cfg)} | dataset {data} | "
        f"{tokens_per_step:,} tokens per step ({accum_steps} micro-steps)"
    )
    if metrics.peak is None:
        logger.info(f"MFU is not known on {info.device.type}: no peak FLOP/s for it; set metrics.peak_tflops to get one")
    validator = None
    if cfg.validation.enable:  # its own loader: validating never moves the training data position
        validator = Validator(cfg.validation, training, tokenizer=tokenizer, dims=dims, device=info.device,
                              seed=cfg.job.seed, metrics=metrics, pipeline=pipeline, delimiters=delimiters,
                              loss_fn=loss_fn)

    checkpointer = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, model=model, optimizer=optimizer, lr_scheduler=scheduler,
        dataloader=dataloader, dp_rank=dims.dp_rank, dp_degree=dims.dp_degree,
        model_name=model_label(cfg.model), model_args=args, hf_adapter=spec.hf_adapter,
        cost=SaveCost(metrics.write_scalars, warmup_steps=cfg.metrics.summary_warmup_steps),
    )
    if cfg.checkpoint.create_seed_checkpoint:
        checkpointer.save_seed()
        checkpointer.close()
        return
    # SIGTERM/SIGUSR1/Ctrl-C and NaN losses; installed before the load, so a signal during it is kept.
    stop = StopFlags(info.device, check_finite=not training.skip_nan_check)
    try:
        state = checkpointer.load()  # resume: model, optimizer, schedule, data position, step
        if nothing_to_train(stop, state.step, training.steps):
            metrics.close()
            return
        batch = tokens_per_step // training.seq_len
        metrics.start_tensorboard(cfg, state.step, hyperparameters(cfg, info.world_size, mesh, batch, speed_settings(cfg)))
        # Python's automatic gc pauses ranks at different moments; collect on a fixed schedule instead.
        gc.disable()
        batches = iter(dataloader)
        summary = RunSummary(cfg.metrics.summary_warmup_steps, training.steps - state.step, info.device,
                             predicted=predict_on_gpu(cfg, spec, args, dims, model, info))
        with profiler:
            for step in range(state.step + 1, training.steps + 1):
                began, validation_seconds = time.perf_counter(), 0.0
                if step % training.gc_freq == 0:
                    gc.collect(1)
                with summary.measure(metrics):
                    loss, grad_norm, lr = train_step(model, optimizer, scheduler, batches, accum_steps, cfg, dims, info.device,
                                                     metrics, loss_fn, pipeline, delimiters, offloaded)
                state.step, state.tokens_seen = step, state.tokens_seen + tokens_per_step
                last, logged = step == training.steps, metrics.should_log(step)
                validating = validator is not None and validator.should_validate(step)
                # A step that is logged, validated or saved must be known finite now; the others are
                # checked one step later, so the host need not wait for the GPU every step.
                settle = last or logged or validating or checkpointer.saves_at(step)
                preempted = stop.should_stop(step, loss, grad_norm, settle)
                if logged:
                    metrics.log(step, mean_over_ranks(loss), grad_norm.item(), lr,
                                extra=(model_metrics(model) or {}) | source_scalars(dataloader))
                if validating and not preempted:
                    validation_seconds = time.perf_counter()
                    validator.validate(model, step)
                    validation_seconds = time.perf_counter() - validation_seconds
                checkpointer.maybe_save(step, last=last, force=preempted)
                # The step's time as a save may have slowed it (validation is not training time).
                checkpointer.cost.step_done(began, time.perf_counter(), left_out=validation_seconds)
                profiler.step(step)
                if preempted:
                    break
    finally:
        checkpointer.close()  # waits for the last async save
        stop.close()
    summary.log(model, optimizer, tokens_per_step // info.world_size, metrics, checkpointer.cost, offloaded)
    log_tokens_by_source(dataloader)
    metrics.close()
    gc.enable()
    if stop.signal:
        logger.info(f"stopped at step {state.step} on {stop.signal}; exiting")
    else:
        logger.info(f"training finished after {training.steps} steps")


def main(argv: list[str]) -> int:
    cfg = info = None
    try:
        cfg = load_config(argv)
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        try:
            train(cfg, info)
        finally:
            close_distributed()
    except UserError as error:
        # Rank 0 speaks for all, except where the ranks did not meet (without torchrun's store):
        # rank 0 may be the one missing.
        never_met = cfg is not None and info is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        if os.environ.get("RANK", "0") == "0" or never_met:
            print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while building the run (from the checkpoint load on, StopFlags handles it)
        print("\ninterrupted (Ctrl-C) before training; nothing was saved", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
