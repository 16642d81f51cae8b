"""What a step trains on: a `MicroBatch` of rows, with what the data carries besides (a chat window's document ids,
GRPO's `RolloutTerms`). The data loaders collate their rows into (inputs, labels) or (inputs, labels,
{"document_ids"}) tuples, which an objective turns into a MicroBatch (`MicroBatch.of`) as it takes them (the
Objective protocol, objectives/contract.py); GRPO's rollout stage (rl/rollout.py) makes MicroBatches itself.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from titanlite.loss import IGNORED


@dataclass(frozen=True)
class Normalizers:
    """The global batch's counts every share of GRPO's loss divides by (rl/loss_family.py's reduce_loss): completions
    (prompts x num_generations), tokens (the completion tokens the mask keeps, summed over every rank),
    max_completion_length, and entropy_tokens: the tokens the entropy bonus averages over (those at or above the
    step's entropy threshold under rl.top_entropy_quantile; None = tokens)."""

    completions: int
    tokens: int
    max_completion_length: int
    entropy_tokens: int | None = None


@dataclass(frozen=True)
class RolloutTerms:
    """What a GRPO micro-batch's loss needs besides its tokens, one row per completion."""

    advantages: torch.Tensor  # [n]
    norm: Normalizers  # the global batch's counts every share of the step's loss divides by
    old_logps: torch.Tensor | None = None  # [n, W] under the policy before its first update (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # [n, W] under the reference (rl.beta > 0)
    sampler_logps: torch.Tensor | None = None  # [n, W] the sampler's, at rl.temperature (rl.importance_sampling)

    def rows(self, part: slice) -> "RolloutTerms":
        def cut(x):
            return None if x is None else x[part]

        return RolloutTerms(
            self.advantages[part], self.norm, cut(self.old_logps), cut(self.ref_logps), cut(self.sampler_logps)
        )


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: rows of inputs and their next-token labels, with what the data carries besides."""

    inputs: torch.Tensor  # [B, T] token ids
    labels: torch.Tensor  # [B, T] the next tokens, IGNORED where nothing is trained
    document_ids: torch.Tensor | None = None  # [B, T] int32 a chat window's carried documents; None: from the inputs
    rollout: RolloutTerms | None = None  # GRPO's

    @classmethod
    def of(cls, batch: tuple) -> "MicroBatch":
        """A data loader's collated (inputs, labels) or (inputs, labels, {"document_ids": ...})."""
        inputs, labels, *rest = batch
        return cls(inputs, labels, rest[0].get("document_ids") if rest else None)

    def trained_tokens(self) -> int:
        return int((self.labels != IGNORED).sum())

    def on(self, device: torch.device, find_documents: Callable[[torch.Tensor], torch.Tensor | None]) -> "MicroBatch":
        """On the device, with its document ids: the carried ones, else find_documents(inputs) (models/attention.py's
        document_ids with the run's delimiters: None under causal attention)."""
        inputs = self.inputs.to(device, non_blocking=True)
        carried = self.document_ids
        documents = carried.to(device, non_blocking=True) if carried is not None else find_documents(inputs)
        return replace(self, inputs=inputs, labels=self.labels.to(device, non_blocking=True), document_ids=documents)
