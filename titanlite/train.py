"""Entry point: python -m titanlite.train --job.config_file X.toml [--section.key value ...]

Reads top to bottom in the order a job happens: config -> mesh -> model -> optimizer -> data ->
loop -> close. Each component comes from one build_* call; this file owns only the loop.
"""

import faulthandler
import gc
import sys
import time
from pathlib import Path

from titanlite.build import build_model, grad_accumulation_steps, model_label, resolve_model_args, seed_everything
from titanlite.checkpoint import CheckpointManager, StopFlags
from titanlite.checkpoint.cost import SaveCost
from titanlite.checkpoint.stopping import NonfiniteSkips, nothing_to_train
from titanlite.config import load_config, write_resolved_config
from titanlite.config_sections import JobConfig
from titanlite.data.datasets import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.fault_tolerance import join_replica_groups
from titanlite.log import init_logger, logger
from titanlite.loss import build_loss
from titanlite.metrics import (MetricsLogger, log_tokens_by_source, mean_over_ranks, model_metrics, source_scalars,
                               speed_features, speed_settings)
from titanlite.models import get_model_spec
from titanlite.models.attention import document_delimiters
from titanlite.observers import observe
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.output_folders import check_output_folders
from titanlite.parallel.cp import sequence_shard
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.dist import DistInfo, close_distributed, exit_process, init_distributed, say_user_error
from titanlite.parallel.float8 import register_float8_scale_precompute
from titanlite.parallel.offload import HeldBytes, note_if_offload_saves_nothing, optimizer_device_type
from titanlite.plan.startup import predict_on_gpu
from titanlite.profiling import RunSummary, StepProfiler
from titanlite.step import StepSettings, train_step
from titanlite.tensorboard import hyperparameters
from titanlite.validation import Validator, check_validation
from titanlite.watchdog import HangWatchdog


def train(cfg: JobConfig, info: DistInfo) -> None:
    check_output_folders(cfg)  # before anything is written: a bad path stops the run now, not at the first save
    init_logger(info.rank, Path(cfg.job.dump_folder) / "logs" if cfg.job.log_rank_files else None)
    if info.allocator_note:
        logger.info(info.allocator_note)
    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, info.rank, info.device)  # memory history from here on
    dims = ParallelDims.from_config(cfg.parallelism, info.world_size)
    dims.build_mesh(info.device.type)
    replicas = join_replica_groups(cfg.fault_tolerance, info, cfg.job.init_timeout_seconds)  # [fault_tolerance]
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
    step_settings = StepSettings.of(cfg, dims, accum_steps)
    delimiters = document_delimiters(cfg.model.attention_mask, tokenizer, cfg.training.dataset)
    training = cfg.training
    shard = sequence_shard(training.seq_len, dims.cp_mesh, info.device) if dims.cp_enabled else None
    dataloader = build_dataloader(
        dataset=training.dataset, dataset_path=training.dataset_path, text_field=training.dataset_text_field,
        tokenizer=tokenizer, seq_len=training.seq_len, batch_size=training.local_batch_size,
        dp_rank=replicas.data_rank(dims), dp_world=replicas.data_world(dims), seed=cfg.job.seed, num_workers=training.num_workers,
        dataset_mix=training.dataset_mix, dataset_format=training.dataset_format, train_on=training.train_on,
        chat_template=training.chat_template,
    )
    metrics = MetricsLogger(cfg.metrics, info.rank, info.device, flops_per_token)
    tokens_per_step = training.local_batch_size * training.seq_len * dims.dp_degree * accum_steps
    if cfg.job.description:
        logger.info(f"job: {cfg.job.description}")
    data = f"a mix of {len(training.dataset_mix)} sources" if training.dataset_mix else training.dataset_path or training.dataset
    mesh = dims.layout
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
                              seed=cfg.job.seed, metrics=metrics, loss_fn=loss_fn, loss_parallel=step_settings.loss_parallel,
                              pipeline=pipeline, delimiters=delimiters)

    checkpointer = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, model=model, optimizer=optimizer, lr_scheduler=scheduler,
        dataloader=dataloader, dp_rank=dims.dp_rank, dp_degree=dims.dp_degree,
        model_name=model_label(cfg.model), model_args=args, hf_adapter=spec.hf_adapter,
        cost=SaveCost(metrics.write_scalars, warmup_steps=cfg.metrics.summary_warmup_steps), tokenizer_file=tokenizer.path,
    )
    checkpointer.writer = replicas.claims_save  # [fault_tolerance]: one replica group writes each checkpoint
    if cfg.checkpoint.create_seed_checkpoint:
        checkpointer.save_seed()
        checkpointer.close()
        return
    # SIGTERM/SIGUSR1/Ctrl-C and NaN losses; installed before the load, so a signal during it is kept.
    stop = StopFlags(info.device, check_finite=training.on_nonfinite == "stop" and not training.skip_nan_check)
    skips = NonfiniteSkips(training.max_nonfinite_skips, metrics.write_scalars)
    watchdog = HangWatchdog(cfg.job.hang_timeout_seconds, info.rank, info.world_size, cfg.job.dump_folder)
    try:
        state = checkpointer.load()  # resume: model, optimizer, schedule, data position, step
        replicas.track(state, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=dataloader,
                       write_scalars=metrics.write_scalars)  # [fault_tolerance]: what a recovering peer receives
        if nothing_to_train(stop, state.step, training.steps):
            metrics.close()
            return
        batch = tokens_per_step // training.seq_len
        metrics.start_tensorboard(cfg, state.step, hyperparameters(cfg, info.world_size, mesh, batch, speed_settings(cfg)))
        # Python's automatic gc pauses ranks at different moments; collect on a fixed schedule instead.
        gc.disable()
        batches = replicas.batches(dataloader)  # [fault_tolerance]: a recovery restarts it at the peer's position
        summary = RunSummary(cfg.metrics.summary_warmup_steps, training.steps - state.step, info.device,
                             predicted=observe("the planner's start-up prediction", predict_on_gpu, cfg, spec, args, dims,
                                               model, info))
        watchdog.start(state.step)
        with profiler:
            for step in replicas.steps(state, training.steps):  # [fault_tolerance]: a quorum before each step
                watchdog.step_began(step)
                began, validation_seconds = time.perf_counter(), 0.0
                if step % training.gc_freq == 0:
                    gc.collect(1)
                summary.step_began(metrics)
                loss, grad_norm, lr, skipped = train_step(model, optimizer, scheduler, batches, step_settings, dims,
                                                          info.device, metrics, loss_fn, pipeline, delimiters, offloaded, shard,
                                                          replicas=replicas)
                summary.step_ended(metrics)
                skips.record(step, skipped)
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
                watchdog.step_ended(step)
                if preempted:
                    break
    finally:
        watchdog.stop()
        replicas.close()  # [fault_tolerance]
        checkpointer.close()  # waits for the last async save
        stop.close()
    summary.log(model, optimizer, tokens_per_step // info.world_size, metrics, checkpointer.cost, offloaded)
    observe("metrics", log_tokens_by_source, dataloader)
    metrics.close()
    gc.enable()
    if stop.signal:
        logger.info(f"stopped at step {state.step} on {stop.signal}; exiting")
    else:
        logger.info(f"training finished after {training.steps} steps")


def main(argv: list[str]) -> int:
    info = None
    try:
        cfg = load_config(argv)
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        try:
            train(cfg, info)
        finally:
            close_distributed()
    except UserError as error:
        say_user_error(f"error: {error}", met=info is not None)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while building the run (from the checkpoint load on, StopFlags handles it)
        print("\ninterrupted (Ctrl-C) before training; nothing was saved", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    # A rank killed by a fatal signal (an abort in a collective library, a segfault) prints every thread's
    # Python stack first: otherwise the job's log says only "Signal 6 received" and not where.
    faulthandler.enable(all_threads=True)
    exit_process(main(sys.argv[1:]))
