"""Stopping cleanly: preemption signals and non-finite losses, agreed on by every rank.

Slurm sends SIGTERM (or the --signal of the job, often SIGUSR1) before the time limit,
Kubernetes sends SIGTERM before eviction, and torchrun forwards SIGTERM to its workers. The
handler only raises a flag; at the end of each step all ranks all-reduce their flags, so they
stop at the same step boundary, save, and exit 0 together, whichever rank got the signal.

Ctrl-C (SIGINT) the first time does the same as SIGTERM (stop at the step boundary, save, exit
0); a second Ctrl-C exits at once with code 130 and no traceback, saving nothing more (a save in
flight stays incomplete and is never loaded). The handlers are installed before the checkpoint
is loaded, so a signal during a long load is kept and the run exits after it, training nothing.

Reading the reduced flags makes the host wait for the GPU. So a step's flags are read at the end
of the next step (the GPU is then still busy with that step's kernels), except where the step
must be known good at once: before a save, a validation, a log line, and at the last step.
"""

import os
import signal

import torch
import torch.distributed as dist

from titanlite.errors import UserError
from titanlite.log import logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlags:
    """One tiny all-reduce per step of [a stop signal arrived, the loss or gradient norm is NaN or inf].

    A non-finite gradient norm counts too: the step's update has already spread it into the weights.
    """

    def __init__(self, device: torch.device, check_finite: bool):
        self.device = device
        self.check_finite = check_finite
        self.signal: str | None = None
        self.first_step: int | None = None  # this run's first step: its loss comes from weights no update touched yet
        self.interrupted = False  # a first Ctrl-C came
        self.unread: list[tuple[int, torch.Tensor]] = []  # (step, its reduced flags) not yet looked at
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in (*SIGNALS, signal.SIGINT)}

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            # os.write, not the logger: a handler may run while the logger holds its lock.
            if self.interrupted:
                os.write(2, b"\nsecond Ctrl-C: exiting now without saving\n")
                os._exit(130)
            os.write(
                2, b"\nCtrl-C: stopping at the end of this step, saving as on SIGTERM; Ctrl-C again to exit at once\n"
            )
            self.interrupted = True
        self.signal = self.signal or ("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    def should_stop(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, settle: bool) -> bool:
        """True on every rank when any rank was signalled; a non-finite loss or gradient norm
        stops the run, naming its step, before anything of that state is saved. With `settle`,
        this step's flags are read now; without, they wait for the next call."""
        self.first_step = step if self.first_step is None else self.first_step
        flags = torch.zeros(2, device=self.device)
        flags[0] = self.signal is not None
        if self.check_finite:
            flags[1] = ~(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach()))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.unread.append((step, flags))
        signalled, keep = False, 0 if settle else 1
        while len(self.unread) > keep:
            flagged_step, flags = self.unread.pop(0)
            stop, nonfinite = flags.tolist()
            if nonfinite:
                raise UserError(nonfinite_sentence(flagged_step, flagged_step == self.first_step))
            if stop:  # a save of this step follows, so it must be known good too
                signalled, keep = True, 0
        if signalled and self.signal is None:
            self.signal = "a stop signal on another rank"
        return signalled

    def signalled_anywhere(self) -> bool:
        """Whether any rank has had a stop signal so far (every rank calls this at the same point)."""
        flag = torch.tensor([float(self.signal is not None)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = "a stop signal on another rank"
        return self.signal is not None

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def nonfinite_sentence(step: int, before_any_update: bool) -> str:
    """Why a step's loss or gradient norm was NaN or inf: at a run's first step no learning rate has acted yet, so
    the weights it started from (or its data) hold them."""
    if before_any_update:
        return (
            f"the loss or the gradient norm is NaN or inf at step {step}, the first of this run, before any update: "
            "the weights it started from (model.hf_assets_path or the checkpoint loaded) hold NaN or inf values, "
            "or the model overflows in its dtype; check those weights (no learning rate is involved yet)"
        )
    return (
        f"the loss or the gradient norm became NaN or inf at step {step}; stopped without saving this state: lower "
        "optimizer.lr or raise lr_scheduler.warmup_steps, or set training.skip_nan_check true to go on"
    )


def nothing_to_train(stop: StopFlags, step: int, steps: int) -> bool:
    """A stop signal during the load, or a resume at or past the last step: exit 0 untrained."""
    if stop.signalled_anywhere():
        logger.info(f"{stop.signal} came while loading; exiting at step {step} without training (nothing new to save)")
        return True
    if step >= steps:
        logger.info(
            f"resumed at step {step}, which is at or past training.steps {steps}: nothing to train; raise "
            "training.steps to train further"
        )
        return True
    return False


class NonfiniteSkips:
    """training.on_nonfinite skip: each skipped step is logged and counted (TensorBoard training/skipped_steps);
    max_in_row skipped steps in a row stop the run."""

    def __init__(self, max_in_row: int, write_scalars):
        self.max_in_row = max_in_row
        self.write_scalars = write_scalars
        self.in_row = self.total = 0

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        logger.warning(
            f"step {step}: the loss or a gradient is NaN or inf; its update was skipped "
            f"({self.in_row} in a row, {self.total} in this run)"
        )
        self.write_scalars(step, {"training/skipped_steps": self.total})
        if self.in_row >= self.max_in_row:
            raise UserError(
                f"{self.in_row} steps in a row (up to step {step}) had a NaN or inf loss or gradient and were skipped "
                f"(training.max_nonfinite_skips {self.max_in_row}); the weights are those of the last good step: lower "
                "optimizer.lr or raise lr_scheduler.warmup_steps, then resume from the last checkpoint"
            )
