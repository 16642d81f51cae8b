"""Rank 0 speaks; other ranks report warnings and errors only, each line tagged with its rank."""

import logging

logger = logging.getLogger("titanlite")


def init_logger(rank: int) -> None:
    handler = logging.StreamHandler()
    prefix = "" if rank == 0 else f"[rank{rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
