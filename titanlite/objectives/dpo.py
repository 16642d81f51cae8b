"""Direct preference optimization (training.dataset_format preference, the [dpo] section).

Each micro-batch holds pairs as rows 2i (chosen) and 2i + 1 (rejected) (data/preference.py). A completion's
log-probability is the sum of its trained tokens' log-probabilities, as TRL sums them; the reference model's come
from a forward without gradients on the same rows. With r = beta x (policy - reference) for each half, the loss
of a pair is
    sigmoid (Rafailov et al. 2023): -(1 - eps) log sigmoid(r_chosen - r_rejected) - eps log sigmoid(r_rejected - r_chosen)
    ipo (Azar et al. 2023):         ((r_chosen - r_rejected) / beta - 1 / (2 beta))^2, log-probabilities averaged
                                    over each completion's tokens (TRL's IPO)
(eps = dpo.label_smoothing), and a micro-batch's loss is the mean over its pairs; the train step divides it by
the micro-steps and FSDP averages it over the data-parallel ranks, so the step's loss is the mean over the global
batch's pairs whatever the layout (every rank holds the same number of pairs).

The reference: dpo.reference initial is the weights training starts from. Under LoRA that is the policy itself
with its adapters switched off (lora.adapters_off): no second copy, one more forward. Otherwise it is a second
model built and sharded exactly like the policy (its parameters: one more copy of the policy's per-rank parameter
bytes, no gradients or optimizer state), loaded from checkpoint.initial_load_path (or initialised from job.seed
like the policy), or from the Hugging Face folder or DCP step folder dpo.reference names.
"""

import contextlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.state import ModelState
from titanlite.checkpoint.weights import ModelIdentity, load_weights
from titanlite.config_sections import DPO, JobConfig
from titanlite.data.conversation_windows import IGNORED
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.lora import adapters_off
from titanlite.models.init import local_tensor

SCALARS = ("dpo/reward_accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward")


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of each row's trained tokens' log-probabilities in fp32, each row's trained tokens). Logits that
    are vocab-sharded DTensors (TP's loss parallel) give the same values through cross-entropy's collectives."""
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORED, reduction="none")
    if isinstance(per_token, DTensor):
        per_token = per_token.full_tensor()
    return -per_token.view(labels.shape).sum(-1), (labels != IGNORED).sum(-1)


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor,
                    cfg: DPO) -> tuple[torch.Tensor, torch.Tensor]:
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
    stats = torch.stack([torch.tensor(float(len(margin)), device=margin.device), (margin > 0).float().sum(),
                         margin.sum(), rewards[:, 0].sum(), rewards[:, 1].sum()])
    return losses.mean(), stats


class Preference:
    """The DPO loss of a micro-batch against the reference, and its statistics since the last log."""

    name = "preference"
    rows_per_example = 2  # rows 2i (chosen) and 2i + 1 (rejected)
    per_trained_token = False  # the step's loss is the mean over pairs
    resets_positions = True  # each sequence starts at position 0, as at inference
    runs_reference_forward = True  # on every sequence, before the policy's (under LoRA: the base, adapters off)

    @classmethod
    def needs_reference_copy(cls, cfg: JobConfig) -> bool:
        """Every reference but the LoRA base's own (which is the policy with its adapters off) is a second model."""
        return not (cfg.dpo.reference == "initial" and cfg.lora.rank > 0)

    @classmethod
    def build(cls, cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str,
              device: torch.device) -> "Preference":
        """The DPO objective with its reference: the policy's base under LoRA with dpo.reference initial, else
        `copy()`, a model built and sharded like the policy (no adapters, initialised from job.seed), frozen and
        loaded through the one checked weight loader."""
        if not cls.needs_reference_copy(cfg):
            logger.info("DPO reference: the LoRA base with its adapters switched off (no second copy)")
            return cls(cfg.dpo, None, device)
        return cls(cfg.dpo, reference_model(cfg, copy, hf_adapter, args, label), device)

    def __init__(self, cfg: DPO, reference: nn.Module | None, device: torch.device):
        self.cfg, self.reference = cfg, reference  # None: the policy with its LoRA adapters off
        self.totals = torch.zeros(5, device=device)

    def forward(self, model: nn.Module, inputs: torch.Tensor, model_kwargs: dict, forward_context: Callable):
        """(logits, the forward's extra losses)."""
        with forward_context():
            return model(inputs, extra_losses=True, **model_kwargs)

    @contextlib.contextmanager
    def reference_of(self, policy: nn.Module):
        """The reference model for one forward without gradients, in eval mode, so that MoE's routing statistics and
        expert balancing count the policy's training forwards only; under LoRA the policy with its adapters off."""
        if self.reference is not None:
            with torch.no_grad():
                yield self.reference
            return
        policy.eval()
        try:
            with torch.no_grad(), adapters_off(policy):
                yield policy
        finally:
            policy.train()

    def loss(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, loss_fn,
             forward_context: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the mean DPO loss of the micro-batch's pairs, the policy forward's extra losses such as MoE's balance
        loss). DPO scores whole completions itself, so the run's token loss_fn is not used."""
        with self.reference_of(model) as reference_model:
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
        logger.info(f"dpo: reward accuracy {correct:.3f}  margin {margin:.4f}  chosen reward {chosen:.4f}  "
                    f"rejected reward {rejected:.4f}")
        return dict(zip(SCALARS, (correct, margin, chosen, rejected)))


def local_bytes(model: nn.Module) -> int:
    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())


def load_reference(reference: nn.Module, path: Path, key: str, identity: ModelIdentity, allow_unverified: bool) -> None:
    """The reference's weights through the one checked loader: the policy's own start (initial) may be another
    model's weights, as the policy's initial load allows; a named reference must be of this model family."""
    try:
        load_weights(ModelState(reference, adapters_only=False), path, identity, key, transplant=key != "dpo.reference",
                     allow_unverified=allow_unverified)
    except UserError as error:
        raise UserError(f"{key} {path} cannot be the reference ({str(error).split('; ')[0]}); point {key} at a Hugging Face "
                        "folder or a DCP step folder of this model, or set dpo.reference initial") from None


def reference_model(cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str) -> nn.Module:
    """A frozen copy of the policy's model, loaded from dpo.reference (or the policy's own start)."""
    reference = copy().requires_grad_(False).eval()  # eval: its forwards stay out of MoE's training statistics
    if cfg.dpo.reference == "initial":
        source, key = cfg.checkpoint.initial_load_path, "checkpoint.initial_load_path"
    else:
        source, key = cfg.dpo.reference, "dpo.reference"
        if not Path(source).is_dir():
            raise UserError(f"dpo.reference {source} is not a folder; set it to initial, a Hugging Face folder or a DCP step folder")
    if source:
        load_reference(reference, Path(source), key, ModelIdentity(label, hf_adapter, args), cfg.checkpoint.allow_unverified)
    origin = source or "job.seed's initialisation"
    logger.info(f"DPO reference: a frozen copy of {origin}, sharded like the policy: {local_bytes(reference) / 2**30:.3f} GiB "
                "of parameters per rank, no gradients or optimizer state")
    return reference
