"""Rank 0 speaks; other ranks report warnings and errors only, each line tagged with its rank.

With job.log_rank_files every rank also writes all its lines, INFO included, to
<dump_folder>/logs/rank<N>.log (appending, so a resumed or restarted run continues the file).

Progress: the line every long job (training, generation, evaluation, data preparation) prints at least every
30 seconds, with items done of total, time per item and time left.
"""

import logging
import time
from pathlib import Path

logger = logging.getLogger("titanlite")


def init_logger(rank: int, rank_files_folder: Path | None = None) -> None:
    line = ("" if rank == 0 else f"[rank{rank}] ") + "%(asctime)s %(levelname)s %(message)s"
    console = logging.StreamHandler()
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(logging.Formatter(line, "%H:%M:%S"))
    handlers: list[logging.Handler] = [console]
    if rank_files_folder is not None:
        rank_files_folder.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(rank_files_folder / f"rank{rank}.log", encoding="utf-8")
        to_file.setFormatter(logging.Formatter(line, "%Y-%m-%d %H:%M:%S"))
        handlers.append(to_file)
    for old in logger.handlers:
        old.close()
    logger.handlers[:] = handlers
    logger.setLevel(logging.INFO)
    logger.propagate = False


def duration(seconds: float) -> str:
    """4s, 3m 05s, 2h 07m: a time a reader takes in at a glance."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def per_item(seconds: float, unit: str) -> str:
    return f"{1000 * seconds:.0f} ms/{unit}" if seconds < 1 else f"{seconds:.2f} s/{unit}"


class Progress:
    """A line at least every `every_seconds` (a monotonic clock) while a long job runs, whatever else it prints:

        progress = Progress(total=len(prompts), label="generate", unit="prompt")
        for prompt in prompts:
            ...
            progress.advance()   # logs `generate: 40/100 prompts (40%)  310 ms/prompt  left 19s` when due
        progress.done()          # logs `generate: 100/100 prompts in 31s (310 ms/prompt)`

    `already` counts items done before this process (a resumed run): they count towards the total, never towards
    the time per item, which is measured since this reporter was made. `total` None counts without a time left.
    Nothing runs in the background: a job that stops advancing prints nothing until it advances again.
    """

    def __init__(
        self,
        total: int | None,
        label: str,
        every_seconds: float = 30.0,
        unit: str = "step",
        already: int = 0,
        clock=time.monotonic,
    ):
        self.total, self.label, self.every_seconds, self.unit = total, label, every_seconds, unit
        self.clock = clock
        self.already = self.count = already
        self.started = self.last_line = clock()

    def seconds_per_item(self) -> float | None:
        done_here = self.count - self.already
        return (self.clock() - self.started) / done_here if done_here else None

    def seconds_left(self) -> float | None:
        per = self.seconds_per_item()
        return None if per is None or self.total is None else per * max(self.total - self.count, 0)

    def status(self) -> str:
        """`40/100 prompts (40%)  310 ms/prompt  left 19s`, from what is known so far."""
        units = f"{self.unit}s"
        text = (
            f"{self.count:,} {units}"
            if self.total is None
            else (f"{self.count:,}/{self.total:,} {units} ({100 * self.count / max(self.total, 1):.0f}%)")
        )
        per, left = self.seconds_per_item(), self.seconds_left()
        if per is not None:
            text += f"  {per_item(per, self.unit)}"
        if left is not None:
            text += f"  left {duration(left)}"
        return text

    def due(self) -> bool:
        return self.clock() - self.last_line >= self.every_seconds

    def reported(self) -> None:
        """Another line just told the reader where the job stands (a training step line): the next is due later."""
        self.last_line = self.clock()

    def skip(self, n: int) -> None:
        """Count `n` items an earlier run finished (a resumed job's): towards the total, not the time per item."""
        self.already += n
        self.count += n

    def advance(self, n: int = 1, quiet: bool = False) -> str | None:
        """Count `n` items done; log and return the progress line when one is due, else None. `quiet` only counts
        (the caller prints a line of its own that says as much, then calls reported())."""
        self.count += n
        if quiet or not self.due():
            return None
        line = f"{self.label}: {self.status()}"
        logger.info(line)
        self.reported()
        return line

    def done(self) -> str:
        """Log and return the closing line: items, wall time and time per item of this process."""
        per = self.seconds_per_item()
        line = f"{self.label}: {self.count:,} {self.unit}s in {duration(self.clock() - self.started)}" + (
            "" if per is None else f" ({per_item(per, self.unit)})"
        )
        logger.info(line)
        return line
