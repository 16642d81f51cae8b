"""Observers never stop training.

Save-cost accounting, metrics, TensorBoard writing, profiling, memory snapshots, the run summary and
the planner's start-up prediction only watch the run. A failure in one of them (a bug of ours, a full
disk under the TensorBoard folder, a profiler that cannot write its trace) must not cost a training
run: the first error is logged once with its cause, that observer turns itself off for the rest of
the run, and training goes on. Their methods carry @observer("name"); a one-off call uses observe().
"""

import functools
import traceback
from typing import Callable

from titanlite.log import logger


def report_failure(name: str, error: Exception) -> None:
    where = traceback.extract_tb(error.__traceback__)[-1]
    logger.warning(
        f"{name} failed and is turned off for the rest of the run; training goes on "
        f"({type(error).__name__}: {error}, at {where.filename}:{where.lineno} in {where.name})"
    )


def observer(name: str) -> Callable:
    """A method of an object that only observes training: once one of its methods marked with the same
    `name` raises, those methods do nothing (and return None) on that object from then on."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            off = self.__dict__.setdefault("_observers_off", set())
            if name in off:
                return None
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                off.add(name)
                report_failure(name, error)
                return None

        return guarded

    return decorate


def observe(name: str, function: Callable, *args, **kwargs):
    """function(*args, **kwargs), or None (logged once) when it raises: for an observer called once."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        report_failure(name, error)
        return None
