"""Direct preference optimization (training.dataset_format preference, the [dpo] section).

Each micro-batch holds pairs as rows 2i (chosen) and 2i + 1 (rejected) (data/preference.py). A completion's
log-probability is the sum of its trained tokens' log-probabilities, as TRL sums them; the reference model's come
from a forward without gradients on the same rows. With r = beta x (policy - reference) for each half, the loss
of a pair is
    sigmoid (Rafailov et al. 2023): -(1 - eps) log sigmoid(r_chosen - r_rejected) - eps log sigmoid(r_rejected -
    r_chosen)
    ipo (Azar et al. 2023):         ((r_chosen - r_rejected) / beta - 1 / (2 beta))^2, log-probabilities averaged
                                    over each completion's tokens (TRL's IPO)
(eps = dpo.label_smoothing), and a micro-batch's loss is the mean over its pairs; the train step divides it by
the micro-steps and FSDP averages it over the data-parallel ranks, so the step's loss is the mean over the global
batch's pairs whatever the layout (every rank holds the same number of pairs).

The reference (objectives/reference.py): dpo.reference initial is the weights training starts from (under LoRA the
policy with its adapters off), or the Hugging Face folder or DCP step folder dpo.reference names.
"""

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config_sections import DPO, JobConfig
from titanlite.data.batch import MicroBatch
from titanlite.data.datasets import training_loader
from titanlite.log import logger
from titanlite.loss import IGNORED
from titanlite.objectives.contract import drawn_batches
from titanlite.objectives.reference import Reference, needs_copy

SCALARS = ("dpo/reward_accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward")


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of each row's trained tokens' log-probabilities in fp32, each row's trained tokens). Logits that
    are vocab-sharded DTensors (TP's loss parallel) give the same values through cross-entropy's collectives."""
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORED, reduction="none")
    if isinstance(per_token, DTensor):
        per_token = per_token.full_tensor()
    return -per_token.view(labels.shape).sum(-1), (labels != IGNORED).sum(-1)


def preference_loss(
    policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, cfg: DPO
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean loss over the pairs, their statistics summed: [pairs, chosen above rejected, margin, chosen reward,
    rejected reward]); policy, reference and counts are per row, pairs as rows (2i, 2i + 1)."""
    if cfg.loss_type == "ipo":
        policy, reference = policy / counts, reference / counts
    ratios = (policy - reference).view(-1, 2)
    rewards = cfg.beta * ratios.detach()
    difference = ratios[:, 0] - ratios[:, 1]
    if cfg.loss_type == "ipo":
        losses = (difference - 1 / (2 * cfg.beta)) ** 2
    else:
        eps = cfg.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(cfg.beta * difference) - eps * F.logsigmoid(-cfg.beta * difference)
    margin = rewards[:, 0] - rewards[:, 1]
    stats = torch.stack(
        [
            torch.tensor(float(len(margin)), device=margin.device),
            (margin > 0).float().sum(),
            margin.sum(),
            rewards[:, 0].sum(),
            rewards[:, 1].sum(),
        ]
    )
    return losses.mean(), stats


class Preference:
    """The DPO loss of a micro-batch against the reference, and its statistics since the last log."""

    name = "preference"
    rows_per_example = 2  # rows 2i (chosen) and 2i + 1 (rejected)
    loss_weighting = "mean"  # the step's loss is the mean over pairs
    rows_may_pack = True  # kept as it was: one sequence and its padding, found by bos like text
    resets_positions = True  # each sequence starts at position 0, as at inference
    generates = False
    runs_reference_forward = True  # on every sequence, before the policy's (under LoRA: the base, adapters off)

    @classmethod
    def needs_reference_copy(cls, cfg: JobConfig) -> bool:
        return needs_copy(cfg.dpo.reference, cfg)

    @classmethod
    def plan_note(cls, cfg) -> str | None:
        return None

    @classmethod
    def build(
        cls, cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str, device: torch.device
    ) -> "Preference":
        """The DPO objective with its reference (objectives/reference.py); `copy()` builds a model sharded like the
        policy."""
        return cls(
            cfg.dpo,
            Reference.build(cfg.dpo.reference, "dpo.reference", cfg, copy, hf_adapter, args, label, "DPO"),
            device,
        )

    def __init__(self, cfg: DPO, frozen: Reference, device: torch.device):
        self.cfg, self.frozen = cfg, frozen
        self.reference = frozen.model  # None: the policy with its LoRA adapters off
        self.totals = torch.zeros(5, device=device)

    def forward(self, model: nn.Module, inputs: torch.Tensor, model_kwargs: dict, forward_context: Callable):
        """(logits, the forward's extra losses)."""
        with forward_context():
            return model(inputs, extra_losses=True, **model_kwargs)

    def dataloader(self, run, dp_rank: int, dp_world: int):
        return training_loader(run, dp_rank, dp_world)

    def step_batches(self, batches: Iterator, accum_steps: int) -> list[MicroBatch]:
        return drawn_batches(batches, accum_steps)

    def loss(
        self, model: nn.Module, batch: MicroBatch, model_kwargs: dict, loss_fn, forward_context: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the mean DPO loss of the micro-batch's pairs, the policy forward's extra losses such as MoE's balance
        loss). DPO scores whole completions itself, so the run's token loss_fn is not used."""
        inputs, labels = batch.inputs, batch.labels
        with self.frozen.of(model) as reference_model:
            reference_logits, _ = self.forward(reference_model, inputs, model_kwargs, forward_context)
            reference, _ = completion_logps(reference_logits, labels)
        logits, extra = self.forward(model, inputs, model_kwargs, forward_context)
        policy, counts = completion_logps(logits, labels)
        loss, stats = preference_loss(policy, reference, counts, self.cfg)
        self.totals += stats
        return loss, extra

    def scalars(self) -> dict[str, float]:
        """The dpo/* means over every pair since the last call, on all ranks (a collective: every rank calls it)."""
        totals = self.totals.clone()
        dist.all_reduce(totals)  # TP ranks count their shared pairs alike: the means are unchanged
        self.totals.zero_()
        correct, margin, chosen, rejected = (totals[1:] / totals[0].clamp(min=1)).tolist()
        logger.info(
            f"dpo: reward accuracy {correct:.3f}  margin {margin:.4f}  chosen reward {chosen:.4f}  "
            f"rejected reward {rejected:.4f}"
        )
        return dict(zip(SCALARS, (correct, margin, chosen, rejected)))
