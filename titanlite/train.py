"""Entry point: python -m titanlite.train --job.config_file X.toml [--section.key value ...]

Reads top to bottom in the order a job happens: config -> mesh -> model -> optimizer -> data ->
loop -> close. Each component comes from one build_* call; this file owns only the loop.
"""

import faulthandler
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from titanlite.build import build_run, build_training
from titanlite.checkpoint.lock import dump_folder_lock
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.output_folders import check_output_folders
from titanlite.checkpoint.stopping import NonfiniteSkips, StopFlags, nothing_to_train
from titanlite.config import load_config, write_resolved_config
from titanlite.config_sections import JobConfig
from titanlite.data.global_order import epochs_done
from titanlite.errors import UserError, sentence
from titanlite.evaluation.in_loop import InLoopEvaluator
from titanlite.fault_tolerance import QuorumEnded
from titanlite.log import init_logger, logger
from titanlite.metrics import (
    MetricsLogger,
    log_tokens_by_source,
    mean_over_ranks,
    model_metrics,
    source_scalars,
    speed_features,
    speed_settings,
)
from titanlite.metrics.observers import observe
from titanlite.metrics.profiling import RunSummary, StepProfiler, state_peaks_over_ranks
from titanlite.metrics.tensorboard import hyperparameters, run_folder
from titanlite.metrics.validation import Validator
from titanlite.parallel.dist import (
    DistInfo,
    close_distributed,
    exit_process,
    init_distributed,
    launch_world_size,
    say_user_error,
)
from titanlite.plan.startup import predict_on_gpu
from titanlite.rl.engine import RolloutStopped
from titanlite.rl.generator import check_generator_ranks, trainers_run
from titanlite.rl.generator_rank import serve
from titanlite.rl.rollout import RolloutStage
from titanlite.run import Run, Training
from titanlite.step import train_step
from titanlite.watchdog import HangWatchdog


def log_start(run: Run, metrics: MetricsLogger) -> None:
    cfg, training = run.cfg, run.cfg.training
    if cfg.job.description:
        logger.info(f"job: {cfg.job.description}")
    data = (
        f"a mix of {len(training.dataset_mix)} sources"
        if training.dataset_mix
        else training.dataset_path or training.dataset
    )
    logger.info(
        f"model {run.label}: {run.num_params:,} parameters, vocab {run.args.vocab_size} | "
        f"world {run.info.world_size} on {run.device.type}, mesh {run.dims.layout} | "
        f"dtype {training.mixed_precision_param} | {speed_features(cfg)} | dataset {data} | "
        f"{run.tokens_per_step:,} tokens per step ({run.step.accum_steps} micro-steps)"
    )
    if metrics.peak is None:
        logger.info(f"MFU is not known on {run.device.type}: no peak FLOP/s for it; set metrics.peak_tflops to get one")


@dataclass
class Loop:
    """What the step loop drives besides the run and its training state, built once by train()."""

    run: Run
    training: Training
    validator: Validator | None
    evaluator: InLoopEvaluator | None  # [eval]: lm-eval tasks on the live model
    checkpointer: CheckpointManager
    profiler: StepProfiler
    stop: StopFlags
    watchdog: HangWatchdog

    def run_steps(self, summary: RunSummary) -> None:
        training = self.training
        skips = NonfiniteSkips(self.run.cfg.training.max_nonfinite_skips, training.metrics.write_scalars)
        replicas, state, first = training.replicas, training.state, training.state.step
        self.restart_batches()
        with replicas.synchronizing():  # DiLoCo's hooks on the optimizer while the loop runs
            while state.step < training.steps:
                self.watchdog.step_began(state.step + 1)  # the quorum's wait included
                summary.step_began(training.metrics)  # the step's time too
                if not replicas.start_step(state.step + 1):  # no quorum: a stop signal or no lighthouse
                    self.save_last_committed(first)
                    break
                self.took_recovery()  # a peer's state, its step and its data position (fault_tolerance/)
                if state.step >= training.steps:  # recovered at the peers' last step
                    break
                try:
                    preempted = self.one_step(skips, summary)
                except QuorumEnded:  # in DiLoCo's synchronization: the inner update is applied, not counted
                    self.save_last_committed(first)
                    break
                except RolloutStopped:  # a stop signal during GRPO's rollout: the last step is saved now
                    self.save_last_committed(first)
                    break
                self.watchdog.step_ended(state.step)
                if preempted:
                    break
        replicas.raise_if_lost()

    def save_last_committed(self, first: int) -> None:
        """A quorum's wait ended without one (a stop signal, or no lighthouse): the last counted step is saved."""
        if self.training.state.step > first:
            self.checkpointer.maybe_save(self.training.state.step, force=True)

    def restart_batches(self) -> None:
        training = self.training
        self.batches = iter(training.dataloader)  # step.py's step_batches counts their trained tokens

    def took_recovery(self) -> bool:
        """Whether a recovery from a peer moved the train state: the batches restart at the peer's data position,
        and the jumped steps, never trained here, are left out of the step line's per-step counts."""
        jump = self.training.replicas.take_recovery()
        if jump is None:
            return False
        self.restart_batches()
        self.training.metrics.last_step += jump
        return True

    def one_step(self, skips: NonfiniteSkips, summary: RunSummary) -> bool:
        """Train, log, validate and save one step; returns whether a stop signal or a NaN ends the run here."""
        run, training, checkpointer = self.run, self.training, self.checkpointer
        metrics, state = training.metrics, training.state
        began, validation_seconds = time.perf_counter(), 0.0
        if (state.step + 1) % run.cfg.training.gc_freq == 0:
            gc.collect(1)
        loss, grad_norm, lr, skipped = train_step(run, training, self.batches)
        summary.step_ended(metrics)
        if not training.replicas.committed:  # logged as not committed; the same step is trained again on the next data
            return False
        skips.record(state.step + 1, skipped)
        # a DiLoCo synchronization in the step may have recovered a peer's step, from which the count goes on
        recovered = self.took_recovery()
        state.step, state.tokens_seen = state.step + 1, state.tokens_seen + run.tokens_per_step
        step = state.step
        last, logged = step == training.steps, metrics.should_log(step) and not recovered
        validating = self.validator is not None and self.validator.should_validate(step)
        # A step that is logged, validated or saved must be known finite now; the others are
        # checked one step later, so the host need not wait for the GPU every step.
        settle = last or logged or validating or checkpointer.saves_at(step)
        preempted = self.stop.should_stop(step, loss, grad_norm, settle)
        metrics.step_done(step, logged)  # a progress line every 30 s between step lines
        if logged:
            metrics.log(
                step,
                mean_over_ranks(loss),
                grad_norm.item(),
                lr,
                extra=(model_metrics(run.model) or {}) | source_scalars(training.dataloader) | run.objective.scalars(),
                trained=metrics.trained_per_step(step),
                epoch=epochs_done(training.dataloader),
            )
        if validating and not preempted:
            validation_seconds = time.perf_counter()
            self.validator.validate(run.model, step)
            validation_seconds = time.perf_counter() - validation_seconds
        if self.evaluator is not None and self.evaluator.should_evaluate(step) and not preempted:
            evaluation_began = time.perf_counter()
            self.evaluator.evaluate(step)
            validation_seconds += time.perf_counter() - evaluation_began
        checkpointer.maybe_save(step, last=last, force=preempted)
        # The step's time as a save may have slowed it (validation and evaluation are not training time).
        checkpointer.cost.step_done(began, time.perf_counter(), left_out=validation_seconds)
        self.profiler.step(step)
        return preempted


def train(cfg: JobConfig, info: DistInfo) -> None:
    with trainers_run(info):  # under rl.generator_ranks: the generators stop as the run ends
        check_output_folders(cfg)  # before anything is written: a bad path stops the run now, not at the first save
        init_logger(info.rank)
        with dump_folder_lock(cfg.job.dump_folder, info.rank):  # one run per dump folder
            if cfg.job.log_rank_files:  # opened once the folder is this run's: a refused run writes nothing there
                init_logger(info.rank, Path(cfg.job.dump_folder) / "logs")
            train_in_folder(cfg, info)


def train_in_folder(cfg: JobConfig, info: DistInfo) -> None:
    """The run, its dump folder checked and held."""
    if info.allocator_note:
        logger.info(info.allocator_note)
    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, info.rank, info.device)  # memory history from here on
    run = build_run(cfg, info)
    training = build_training(run)
    if info.rank == 0:
        write_resolved_config(cfg, Path(cfg.job.dump_folder))
    metrics = training.metrics
    log_start(run, metrics)
    validator = Validator(run, metrics) if cfg.validation.enable else None  # its own loader: never moves training's
    evaluator = InLoopEvaluator(run, training) if cfg.eval.interval or cfg.eval.at_end else None
    checkpointer = CheckpointManager(run, training)
    if cfg.checkpoint.create_seed_checkpoint:
        checkpointer.save_seed()
        checkpointer.close()
        return
    # SIGTERM/SIGUSR1/Ctrl-C and NaN losses; installed before the load, so a signal during it is kept.
    stop = StopFlags(info.device, check_finite=cfg.training.on_nonfinite == "stop" and not cfg.training.skip_nan_check)
    watchdog = HangWatchdog(cfg.job.hang_timeout_seconds, info.rank, info.world_size, cfg.job.dump_folder)
    if isinstance(training.dataloader, RolloutStage):
        training.dataloader.stop_when(lambda: stop.signal is not None)
    loop = Loop(run, training, validator, evaluator, checkpointer, profiler, stop, watchdog)
    state = training.state
    try:
        checkpointer.load()  # resume: model, optimizer, schedule, data position, step (into training.state)
        if nothing_to_train(stop, state.step, training.steps):
            metrics.close()
            return
        # The lighthouse; a recovering peer receives this group's checkpoint objects, and this group takes a peer's.
        training.replicas.join(
            info,
            cfg.job.init_timeout_seconds,
            model=run.model,
            dataloader=training.dataloader,
            objects=checkpointer.objects,
            write_scalars=metrics.write_scalars,
            stopping=lambda: stop.signal is not None,
        )
        hparams = hyperparameters(
            cfg, info.world_size, run.dims.layout, run.tokens_per_step // cfg.training.seq_len, speed_settings(cfg)
        )
        metrics.start_tensorboard(run_folder(cfg, info.rank, state.step), cfg, state.step, hparams)
        metrics.start_progress(state.step, training.steps)
        # Python's automatic gc pauses ranks at different moments; collect on a fixed schedule instead.
        gc.disable()
        summary = RunSummary(
            cfg.metrics.summary_warmup_steps,
            training.steps - state.step,
            info.device,
            predicted=observe("the planner's start-up prediction", predict_on_gpu, run),
        )
        watchdog.start(state.step)
        with profiler:
            loop.run_steps(summary)
    finally:
        training.replicas.close()
        watchdog.stop()
        checkpointer.close()  # waits for the last async save
        stop.close()
    summary.log(
        state_peaks_over_ranks(run.model, training.optimizer, run.forward.offloaded),
        metrics,
        checkpointer.cost,
        run.forward.offloaded,
    )
    observe("metrics", log_tokens_by_source, training.dataloader)
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
        check_generator_ranks(cfg, launch_world_size())
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds, cfg.rl.generator_ranks)
        try:
            (serve if info.generating else train)(cfg, info)  # a generator rank only generates (rl.generator_ranks)
        finally:
            close_distributed()
    except UserError as error:
        say_user_error(f"error: {sentence(error)}", met=info is not None)  # a DataLoader worker's too
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
