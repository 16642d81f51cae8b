"""Language modelling: next-token cross-entropy, on text (every token trained) or on conversations (chat and
prompt/completion data: only the tokens the template marks are trained, and the step's loss is their mean over
the whole global batch, loss.py's per_trained_token)."""

from collections.abc import Callable, Iterator

import torch
from torch import nn

from titanlite.data.batch import MicroBatch
from titanlite.data.datasets import training_loader
from titanlite.loss import micro_batch_loss
from titanlite.objectives.contract import drawn_batches


class LanguageModelling:
    """Text: every window's tokens are trained, positions run on across the documents of a window unless
    model.reset_position_ids says otherwise."""

    name = "text"
    rows_per_example = 1  # a batch row is one window
    loss_weighting = "mean"  # each micro-batch's mean enters the step as one of its equal parts
    rows_may_pack = True  # a window may hold several documents, told apart by their bos (model.attention_mask)
    resets_positions = False
    runs_reference_forward = False
    generates = False
    reference = None

    @classmethod
    def needs_reference_copy(cls, cfg) -> bool:
        return False

    @classmethod
    def plan_note(cls, cfg) -> str | None:
        return None

    def dataloader(self, run, dp_rank: int, dp_world: int):
        return training_loader(run, dp_rank, dp_world)

    def step_batches(self, batches: Iterator, accum_steps: int) -> list[MicroBatch]:
        return drawn_batches(batches, accum_steps)

    def loss(
        self, model: nn.Module, batch: MicroBatch, model_kwargs: dict, loss_fn, forward_context: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the mean loss of the micro-batch's trained tokens, the extra losses the model's forward returned)."""
        return micro_batch_loss(model, batch.inputs, batch.labels, model_kwargs, loss_fn, forward_context())

    def scalars(self) -> dict[str, float]:
        return {}


class Conversations(LanguageModelling):
    """Chat and prompt/completion data: the loss over the trained tokens of the whole global batch, each
    conversation at positions from 0, as at inference."""

    name = "conversations"
    loss_weighting = "trained_token"
    resets_positions = True
