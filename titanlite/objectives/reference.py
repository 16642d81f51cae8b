"""A frozen reference model, for objectives that keep their policy near one (DPO, GRPO's KL penalty).

`initial` is the weights training starts from. Under LoRA that is the policy itself with its adapters switched off
(lora.adapters_off): no second copy, one more forward. Otherwise it is a second model built and sharded exactly
like the policy (its parameters: one more copy of the policy's per-rank parameter bytes, no gradients or optimizer
state), loaded from checkpoint.initial_load_path (or initialised from job.seed like the policy), or from the
Hugging Face folder or DCP step folder the objective's `reference` key names, through the one checked loader.
"""

import contextlib
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from titanlite.checkpoint.state import ModelState
from titanlite.checkpoint.weights import ModelIdentity, load_weights
from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.init import local_tensor
from titanlite.models.lora import adapters_off


def needs_copy(reference: str, cfg: JobConfig) -> bool:
    """Every reference but the LoRA base's own (which is the policy with its adapters off) is a second model."""
    return not (reference == "initial" and cfg.lora.rank > 0)


class Reference:
    """The reference of one run: a frozen copy, or None for the policy with its LoRA adapters off."""

    def __init__(self, model: nn.Module | None):
        self.model = model

    @classmethod
    def build(
        cls,
        reference: str,
        key: str,
        cfg: JobConfig,
        copy: Callable[[], nn.Module],
        hf_adapter,
        args,
        label: str,
        who: str,
    ) -> "Reference":
        """`reference` is the objective's setting (initial or a path) under the config key `key`; `who` names the
        objective in the log."""
        if not needs_copy(reference, cfg):
            logger.info(f"{who} reference: the LoRA base with its adapters switched off (no second copy)")
            return cls(None)
        return cls(frozen_copy(reference, key, cfg, copy, hf_adapter, args, label, who))

    @contextlib.contextmanager
    def of(self, policy: nn.Module):
        """The reference model for forwards without gradients, in eval mode, so that MoE's routing statistics and
        expert balancing count the policy's training forwards only; under LoRA the policy with its adapters off."""
        if self.model is not None:
            with torch.no_grad():
                yield self.model
            return
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad(), adapters_off(policy):
                yield policy
        finally:
            policy.train(was_training)


def local_bytes(model: nn.Module) -> int:
    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())


def load_reference(
    reference: nn.Module, path: Path, key: str, identity: ModelIdentity, allow_unverified: bool, setting: str
) -> None:
    """The reference's weights through the one checked loader: the policy's own start (initial) may be another
    model's weights, as the policy's initial load allows; a named reference must be of this model family."""
    try:
        load_weights(
            ModelState(reference, adapters_only=False),
            path,
            identity,
            key,
            transplant=key != setting,
            allow_unverified=allow_unverified,
        )
    except UserError as error:
        raise UserError(
            f"{key} {path} cannot be the reference ({str(error).split('; ')[0]}); point {key} at a Hugging Face "
            f"folder or a DCP step folder of this model, or set {setting} initial"
        ) from None


def frozen_copy(
    reference: str, setting: str, cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str, who: str
) -> nn.Module:
    """A frozen copy of the policy's model, loaded from the setting's path (or the policy's own start)."""
    model = copy().requires_grad_(False).eval()  # eval: its forwards stay out of MoE's training statistics
    if reference == "initial":
        source, key = cfg.checkpoint.initial_load_path, "checkpoint.initial_load_path"
    else:
        source, key = reference, setting
        if not Path(source).is_dir():
            raise UserError(
                f"{setting} {source} is not a folder; set it to initial, a Hugging Face folder or a DCP step folder"
            )
    if source:
        load_reference(
            model, Path(source), key, ModelIdentity(label, hf_adapter, args), cfg.checkpoint.allow_unverified, setting
        )
    origin = source or "job.seed's initialisation"
    logger.info(
        f"{who} reference: a frozen copy of {origin}, sharded like the policy: {local_bytes(model) / 2**30:.3f} GiB "
        "of parameters per rank, no gradients or optimizer state"
    )
    return model
