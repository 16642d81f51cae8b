"""Rollouts sampled ahead (rl.max_staleness K >= 1), on a fixed schedule, so that a run and its resume are the same
run: step s trains on completions sampled by the weights after step max(0, s - 1 - K). At the start of step s, with
the weights after step s - 1, the engine is handed step s + K's prompts (RolloutEngine.submit: the colocated engine
copies the weights then and decodes on a thread of its own while steps s .. s + K - 1 train); a fresh run first
samples steps 1 .. K + 1 with the initial weights. The completions not yet trained on (the one batch in flight
waited for) are checkpoint state.
"""

import time
from concurrent.futures import Future
from dataclasses import dataclass

from titanlite.rl.engine import Completion, RolloutStopped
from titanlite.rl.prompts import PromptItem


@dataclass
class Sampled:
    """One step's prompts (this rank's) and their completions, sampled ahead."""

    items: list[PromptItem]
    completions: list[Completion]
    seconds: float  # the decode's


@dataclass
class InFlight:
    step: int
    items: list[PromptItem]
    future: Future
    began: float  # when it was handed to the engine: the decode's seconds include its wait behind earlier ones
    position: dict  # the prompt order's state before this step's prompts were taken

    def result(self) -> Sampled:
        completions = self.future.result()
        return Sampled(self.items, completions, time.perf_counter() - self.began)


class Ahead:
    """The steps sampled and not yet trained, and those being sampled (the engine decodes them in order), each with
    the prompt order's position before its prompts were taken."""

    def __init__(self, staleness: int):
        self.staleness = staleness
        self.done: dict[int, Sampled] = {}
        self.flying: dict[int, InFlight] = {}

    def launch(self, step: int, items: list[PromptItem], future: Future, position: dict) -> None:
        self.flying[step] = InFlight(step, items, future, time.perf_counter(), position)

    def missing(self, step: int) -> list[int]:
        """The steps from `step` to step + K neither sampled nor being sampled, in order."""
        return [s for s in range(step, step + self.staleness + 1) if s not in self.done and s not in self.flying]

    def land(self, upto: float) -> bool:
        """Waits for the batches in flight up to step `upto`; whether a stop signal ended one (RolloutStopped)."""
        stopped = False
        for step in sorted(s for s in self.flying if s <= upto):
            try:
                self.done[step] = self.flying.pop(step).result()
            except RolloutStopped:
                stopped = True
        return stopped

    def drop_flights(self) -> dict | None:
        """After a stop: every batch in flight or landed from one is forgotten (waited for: a stopped decode ends
        at its next token); returns the prompt order's position before the first of them (None: there were none)."""
        first = min(self.flying, default=None)
        position = self.flying[first].position if first is not None else None
        self.land(float("inf"))
        for step in [s for s in self.done if first is not None and s >= first]:
            del self.done[step]
        return position

    def state_dict(self) -> dict:
        return {"staleness": self.staleness, "done": dict(self.done)}

    def load_state_dict(self, state: dict) -> None:
        self.done, self.flying = dict(state["done"]), {}
