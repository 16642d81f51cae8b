"""Rank 0 speaks; other ranks report warnings and errors only, each line tagged with its rank.

With job.log_rank_files every rank also writes all its lines, INFO included, to
<dump_folder>/logs/rank<N>.log (appending, so a resumed or restarted run continues the file).
"""

import logging
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
