"""What a run trains for, chosen once from the data format: language modelling on text or conversations (lm.py),
preference tuning (DPO, dpo.py) or reinforcement learning on prompts (GRPO, grpo.py). Outside data/ and the config, this
is the one module that reads training.dataset_format; the step, the planner and the checkpoint ask the objective,
whose contract is contract.py's `Objective` protocol, and what it hands the step is data/batch.py's `MicroBatch`.
"""

import dataclasses
from typing import Callable

import torch
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.objectives.dpo import Preference
from titanlite.objectives.grpo import GRPO
from titanlite.objectives.lm import Conversations, LanguageModelling


def objective_class(cfg: JobConfig) -> type:
    """The objective's class, whose static facts the build and the planner read before any model exists."""
    if cfg.training.dataset_format == "preference":
        return Preference
    if cfg.training.dataset_format == "prompts":
        return GRPO
    return LanguageModelling if cfg.training.dataset_format == "text" else Conversations


def holds_reference_copy(cfg: JobConfig) -> bool:
    """Whether the objective keeps a frozen second model (the planner counts its bytes)."""
    return objective_class(cfg).needs_reference_copy(cfg)


def as_sequences(cfg: JobConfig) -> JobConfig:
    """The job with its batch keys counting sequences, not examples (the planner's view): a preference pair is two."""
    rows = objective_class(cfg).rows_per_example
    if rows == 1:
        return cfg
    training = cfg.training
    counted = dataclasses.replace(
        training,
        local_batch_size=rows * training.local_batch_size,
        global_batch_size=rows * training.global_batch_size if training.global_batch_size > 0 else -1,
    )
    return dataclasses.replace(cfg, training=counted)


def build_objective(
    cfg: JobConfig, copy_model: Callable[[], nn.Module], hf_adapter, args, label: str, device: torch.device
):
    """The run's objective; `copy_model()` builds a model sharded like the policy, for a reference that needs one."""
    kind = objective_class(cfg)
    if kind in (Preference, GRPO):
        return kind.build(cfg, copy_model, hf_adapter, args, label, device)
    return kind()
