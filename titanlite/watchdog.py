"""A hung rank is named: job.hang_timeout_seconds.

A collective that never completes (a rank died without the launcher noticing, a deadlock, a rank
stuck in I/O) leaves every other rank waiting: forever on gloo, NCCL's 10 minutes on a GPU, and the
job never says who. Each rank runs a watchdog thread. The training loop marks the start and the end
of every step (a fault-tolerance quorum's wait before it, its log line, validation and save included: a
quorum that never comes is a hang too); the thread publishes the last step its
rank finished to the job's rendezvous store, and when a step has run longer than the timeout:

- the rank dumps every thread's Python stack (faulthandler) to <dump_folder>/logs/rank<N>.log and
  publishes where its main thread is;
- rank 0 waits a little for the others' reports, then names the ranks that did not finish the step
  and what each was doing (a rank that reports nothing has likely died);
- every rank exits with code 3, so torchrun fails the job and the scheduler restarts it from the
  last checkpoint.
Only the thread talks to the store, never the training loop, so watching costs a step nothing.
"""

import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch.distributed as dist

from titanlite.log import logger

HANG_EXIT_CODE = 3
FIRST_STEPS_SECONDS = 1800  # before a steady step time is known: compilation, allocator warm-up
FLOOR_SECONDS = 300
STEADY_FACTOR = 20
KEY = "titanlite/watchdog"
JOIN_SECONDS = 30  # how long stop() waits for a store call in flight (the store answers in milliseconds)


def where_thread_is(thread_id: int) -> str:
    """The innermost frame of a thread, and the innermost frame of titanlite's own code on its stack."""
    frames = traceback.extract_stack(sys._current_frames()[thread_id])
    innermost = frames[-1]
    ours = next((f for f in reversed(frames) if f"{os.sep}titanlite{os.sep}" in f.filename), None)
    text = f"{innermost.name} ({innermost.filename}:{innermost.lineno})"
    if ours is not None and ours is not innermost:
        text += f", called from {ours.name} ({ours.filename}:{ours.lineno})"
    return text


class HangWatchdog:
    def __init__(self, timeout_seconds: int, rank: int, world_size: int, dump_folder: str):
        """timeout_seconds: job.hang_timeout_seconds (-1 automatic, 0 off)."""
        self.fixed = timeout_seconds if timeout_seconds > 0 else None
        self.enabled = timeout_seconds != 0
        self.rank, self.world_size = rank, world_size
        self.stack_file = Path(dump_folder) / "logs" / f"rank{rank}.log"
        self.store = dist.distributed_c10d._get_default_store() if world_size > 1 else None
        self.main_thread = threading.main_thread().ident
        self.durations: deque[float] = deque(maxlen=20)
        self.step, self.began, self.finished = (
            0,
            time.monotonic(),
            0,
        )  # the step in progress, its start, the last finished
        self.published = -1
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def timeout(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if len(self.durations) < 3:
            return FIRST_STEPS_SECONDS
        return max(FLOOR_SECONDS, STEADY_FACTOR * statistics.median(self.durations))

    def start(self, resumed_step: int) -> None:
        self.finished = resumed_step
        if self.enabled:
            self.thread.start()

    def step_began(self, step: int) -> None:
        self.step, self.began = step, time.monotonic()

    def step_ended(self, step: int) -> None:
        self.durations.append(time.monotonic() - self.began)
        self.finished = step

    def stop(self) -> None:
        """Stop watching and wait for the thread to leave: a daemon thread still inside a store call when the
        interpreter shuts down is unwound through C++ frames, and the process aborts ("terminate called
        without an active exception", seen at the end of finished gloo runs)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=JOIN_SECONDS)

    def _watch(self) -> None:
        while not self.stopped.wait(min(5.0, self.timeout() / 10)):
            if self.store is not None and self.finished != self.published:
                self.published = self.finished
                self.store.set(f"{KEY}/finished/{self.rank}", str(self.published))
            if self.step > self.finished and time.monotonic() - self.began > self.timeout():
                self._report_hang()

    def _report_hang(self) -> None:
        step, waited = self.step, time.monotonic() - self.began
        doing = where_thread_is(self.main_thread)
        self.stack_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.stack_file, "a") as stacks:
            stacks.write(f"\n--- hang watchdog: step {step} has run {waited:.0f}s; every thread's stack:\n")
            stacks.flush()
            faulthandler.dump_traceback(file=stacks, all_threads=True)
        logger.error(
            f"step {step} has run {waited:.0f}s, over the hang timeout of {self.timeout():.0f}s; this rank is in "
            f"{doing}; its stacks are in {self.stack_file}"
        )
        if self.store is not None:
            # The last finished step travels with the report: the periodic publication may lag it by an interval.
            self.store.set(f"{KEY}/hung/{self.rank}", f"{self.finished}|step {step}: {doing}")
            if self.rank == 0:
                logger.error(self._who_did_not_finish(step))
            else:
                time.sleep(self._grace() + 2)  # rank 0 reads this rank's report meanwhile
        for handler in logger.handlers:
            handler.flush()
        os._exit(HANG_EXIT_CODE)

    def _grace(self) -> float:
        return min(30.0, self.timeout())

    def _read(self, kind: str, rank: int) -> str | None:
        key = f"{KEY}/{kind}/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _who_did_not_finish(self, step: int) -> str:
        """Rank 0's sentence: the ranks behind the others, each with its last finished step and where it is."""
        deadline = time.monotonic() + self._grace()
        while time.monotonic() < deadline and any(self._read("hung", r) is None for r in range(self.world_size)):
            time.sleep(0.5)
        reports = {r: self._read("hung", r) for r in range(self.world_size)}
        finished = {
            r: int(report.split("|", 1)[0]) if report else int(self._read("finished", r) or 0)
            for r, report in reports.items()
        }
        finished[0] = self.finished
        stuck_step = min(finished.values()) + 1
        behind = [r for r, done in finished.items() if done < stuck_step]
        parts = []
        for r in range(self.world_size):
            report = reports[r].split("|", 1)[1] if reports[r] else None
            parts.append(
                f"rank {r} finished step {finished[r]}, "
                + (f"now in {report}" if report else "sent no report (it may have died)")
            )
        return (
            f"hang: rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} did not finish step {stuck_step}; "
            f"{'; '.join(parts)}; every rank's stacks are in its logs/rank<N>.log; exiting with code {HANG_EXIT_CODE} "
            "so the job restarts from its last checkpoint"
        )
