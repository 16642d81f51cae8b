"""What a checkpoint save really cost the training loop.

The time a save blocks the loop (building the state dicts, waiting for the staging copy) is only
part of its cost: while an async save copies and writes in the background, it competes with
training for memory bandwidth, CPU cores and PCIe, and the steps it overlaps run slower. So the
cost of a save is measured on the steps themselves: every training step whose time overlaps the
save (from its start until its write completed, which includes the step whose optimizer waited
for the staging copy) is compared with the steady step time, the median of the recent steps no
save touched after warm-up, and the sum of the differences is the training time the save lost
(never less than the time it blocked the loop, which those steps contain).
A step touched by two saves (the later one waited for the earlier one's write) is shared between
them by how long each overlapped it.

The training loop feeds step_done() once per step; the CheckpointManager feeds save_finished()
(and waited_for_previous()); once a few untouched steps have followed the write (or at the end
of the run), the figure is logged ("checkpoint step-N: training lost X s"), written to
TensorBoard and summed for the run summary.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

from titanlite.log import logger
from titanlite.metrics.observers import observer

STEADY_WINDOW = 20  # recent untouched steps whose median is the steady step time
CLEAN_AFTER = 3  # untouched steps after a save's write before it is reported (the steady time includes them)


@dataclass
class _Step:
    began: float
    ended: float
    seconds: float  # its training time (validation left out)
    warmup: bool  # too early to say what a steady step takes


@dataclass
class _Save:
    step: int
    started: float
    done_at: float
    blocked: float

    def overlap(self, step: _Step) -> float:
        return max(0.0, min(step.ended, self.done_at) - max(step.began, self.started))


class SaveCost:
    """Collects step times and finished saves; reports each save's training time lost.

    `write(step, scalars)` receives {"checkpoint/save_seconds", "checkpoint/blocked_seconds",
    "checkpoint/training_lost_seconds"} at the save's step (e.g. MetricsLogger.write_scalars).
    """

    def __init__(self, write: Callable[[int, dict[str, float]], None] | None = None, warmup_steps: int = 0):
        self.write = write
        self.warmup_steps = warmup_steps
        self.steps: deque[_Step] = deque(maxlen=8 * STEADY_WINDOW)
        self.finished: deque[_Save] = deque(maxlen=STEADY_WINDOW)  # recent saves, for steps two saves touched
        self.waiting: list[_Save] = []  # finished, not yet reported
        self.seen = 0  # steps fed
        self.saves = 0
        self.lost_seconds = 0.0
        self.warned_overlap = False

    # ---------------------------------------------------------------- fed by the loop
    @observer("save-cost accounting")
    def step_done(self, began: float, ended: float, left_out: float = 0.0) -> None:
        """A training step ran from `began` to `ended` (perf_counter), of which `left_out` seconds
        were not training (validation)."""
        self.seen += 1
        self.steps.append(_Step(began, ended, ended - began - left_out, warmup=self.seen <= self.warmup_steps))
        clean = self._clean_steps()
        for save in list(self.waiting):
            # Saves every few steps may leave no untouched step at all: report a save before the
            # steps it touched fall out of the window, whatever follows it.
            if sum(s.began >= save.done_at for s in clean) >= CLEAN_AFTER or len(self.waiting) > STEADY_WINDOW:
                self.waiting.remove(save)
                self._report(save)

    # ---------------------------------------------------------------- fed by the CheckpointManager
    @observer("save-cost accounting")
    def save_finished(self, step: int, started: float, done_at: float, blocked: float) -> None:
        """A save is complete on disk; it is reported once a few untouched steps have followed it."""
        save = _Save(step, started, done_at, blocked)
        self.finished.append(save)
        self.waiting.append(save)

    @observer("save-cost accounting")
    def waited_for_previous(
        self, step: int, previous: int, previous_started: float, previous_done: float, entered: float, interval: int
    ) -> None:
        """The save of `step` had to wait (from `entered`) for the save of `previous` to finish
        writing. When the interval is to blame, say so once, with the interval that avoids it:
        the write took as long as that many steps ran while it wrote."""
        if self.warned_overlap or step - previous != interval:
            return  # only interval saves can be spaced out; a last or forced save may come early
        self.warned_overlap = True
        write_seconds = previous_done - previous_started
        step_seconds = (entered - previous_started) / interval
        logger.warning(
            f"checkpoint step-{step} waited {previous_done - entered:.2f}s for step-{previous}'s save, which took "
            f"{write_seconds:.2f}s to write while steps took {step_seconds:.3f}s: with checkpoint.interval {interval} "
            f"every save blocks training for the rest of the previous write; set checkpoint.interval to "
            f"{math.ceil(write_seconds / step_seconds) + 1} or more to avoid it"
        )

    @observer("save-cost accounting")
    def flush(self) -> None:
        """At the end: report the saves still waiting, with the steps that ran."""
        for save in self.waiting:
            self._report(save)
        self.waiting = []

    # ---------------------------------------------------------------- the figure
    def _clean_steps(self) -> list[_Step]:
        return [s for s in self.steps if not s.warmup and not any(save.overlap(s) for save in self.finished)]

    def steady_step(self) -> float | None:
        """Median time of the recent steps after warm-up that no save touched (None before there is one)."""
        clean = [s.seconds for s in self._clean_steps()]
        return statistics.median(clean[-STEADY_WINDOW:]) if clean else None

    def lost(self, save: _Save, steady: float) -> tuple[float, int]:
        """(extra seconds of the steps `save` touched over `steady`, how many steps). A step that
        two saves touched is shared between them by how long each overlapped it."""
        # Every save that may have touched a step: the recent ones, and those still waiting to be
        # reported (with saves every step, `finished` may have dropped this very save already).
        saves = {id(other): other for other in (*self.finished, *self.waiting, save)}.values()
        total, count = 0.0, 0
        for step in self.steps:
            if save.overlap(step):
                share = save.overlap(step) / sum(other.overlap(step) for other in saves)
                total += (step.seconds - steady) * share
                count += 1
        return total, count

    def _report(self, save: _Save) -> None:
        steady = self.steady_step()
        lost, count = self.lost(save, steady) if steady is not None else (0.0, 0)
        if count:
            how = f"{count} step{'s' * (count > 1)} over a steady {steady:.3f}s"
            # The touched steps hold the loop's wait, so the save cost at least that; a smaller figure (even
            # a negative one, on a noisy machine) is the steady time's noise, not a save that cost nothing.
            lost = max(lost, save.blocked)
        else:  # nothing to compare with: what the loop waited is all that is known
            lost, how = save.blocked, "no steady step to compare with"
        self.saves += 1
        self.lost_seconds += lost
        logger.info(f"checkpoint step-{save.step}: training lost {lost:.3f}s ({how}; blocked {save.blocked:.3f}s)")
        if self.write:
            self.write(
                save.step,
                {
                    "checkpoint/save_seconds": save.done_at - save.started,
                    "checkpoint/blocked_seconds": save.blocked,
                    "checkpoint/training_lost_seconds": lost,
                },
            )
