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

from titanlite.rl.engine import Completion
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

    def result(self) -> Sampled:
        completions = self.future.result()
        return Sampled(self.items, completions, time.perf_counter() - self.began)


class Ahead:
    """The steps sampled and not yet trained, and those being sampled (the engine decodes them in order)."""

    def __init__(self, staleness: int):
        self.staleness = staleness
        self.done: dict[int, Sampled] = {}
        self.flying: dict[int, InFlight] = {}

    def launch(self, step: int, items: list[PromptItem], future: Future) -> None:
        self.flying[step] = InFlight(step, items, future, time.perf_counter())

    def take(self, step: int) -> tuple[Sampled, float]:
        """(step's completions, the seconds waited for them)."""
        waited = time.perf_counter()
        if step in self.flying:
            self.done[step] = self.flying.pop(step).result()
        return self.done.pop(step), time.perf_counter() - waited

    def missing(self, step: int) -> list[int]:
        """The steps from `step` to step + K neither sampled nor being sampled, in order."""
        return [s for s in range(step, step + self.staleness + 1) if s not in self.done and s not in self.flying]

    def state_dict(self) -> dict:
        for step in sorted(self.flying):
            self.done[step] = self.flying.pop(step).result()
        return {"staleness": self.staleness, "done": dict(self.done)}

    def load_state_dict(self, state: dict) -> None:
        self.done, self.flying = dict(state["done"]), {}
