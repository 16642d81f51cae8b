"""The contract between the train step and an objective: the `Objective` protocol every objective (objectives/lm.py,
dpo.py, grpo.py) follows; what it hands the step is a data/batch.py `MicroBatch`.
"""

from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol

import torch
from torch import nn

from titanlite.data.batch import MicroBatch


class Objective(Protocol):
    """What a run trains for, chosen once from training.dataset_format (objectives/__init__.py); the step, the planner
    and the checkpoint ask it, never the format string."""

    name: ClassVar[str]
    rows_per_example: ClassVar[int]  # batch rows per example (a preference pair is two sequences)
    # How a micro-batch's loss enters the step's: "mean" (an equal part), "trained_token" (the mean over the global
    # batch's trained tokens) or "share" (loss() gives its micro-batch's share of the global batch's loss itself).
    loss_weighting: ClassVar[str]
    rows_may_pack: ClassVar[bool]  # a row may hold several documents, told apart by their bos (block_causal)
    resets_positions: ClassVar[bool]  # each example starts at position 0 (conversations, as at inference)
    runs_reference_forward: ClassVar[bool]  # every step also runs a reference model's forward (the planner counts it)
    generates: ClassVar[
        bool
    ]  # its batches are generated (rl/*_seconds), not read: the step line's data: leaves them out
    reference: nn.Module | None  # its frozen second model (DPO's reference), or None

    @classmethod
    def needs_reference_copy(cls, cfg) -> bool:
        """Whether a job's objective keeps a frozen copy of the model (before it is built: the planner)."""

    @classmethod
    def plan_note(cls, cfg) -> str | None:
        """What the planner leaves out of its step, or None."""

    def dataloader(self, run, dp_rank: int, dp_world: int):
        """Its stateful source of batches (checkpoint state): a data loader, or GRPO's rollout stage."""

    def step_batches(self, batches: Iterator, accum_steps: int) -> list[MicroBatch]:
        """The next optimizer step's micro-batches (on the host), drawn from iter(its dataloader)."""

    def loss(
        self, model: nn.Module, batch: MicroBatch, model_kwargs: dict, loss_fn, forward_context: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the micro-batch's loss as loss_weighting says, the extra losses the policy's forward returned: MoE, MTP)."""

    def scalars(self) -> dict[str, float]:
        """Its TensorBoard scalars since the last call (a collective: every rank calls it)."""


def drawn_batches(batches: Iterator, accum_steps: int) -> list[MicroBatch]:
    """A read objective's step: the data loader's next accum_steps collated batches."""
    return [MicroBatch.of(next(batches)) for _ in range(accum_steps)]
