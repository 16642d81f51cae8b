"""The job config: one dataclass per TOML section, every field typed, defaulted and documented.

`opt(default, doc, ...)` declares a field; the doc (with its choices or range) becomes its `--help` line.
Every numeric field declares its valid range (at_least/above/at_most/below, sentinels, length), which
the loader checks and a fuzz test (tests/test_config_fuzz.py) requires.
"""

from dataclasses import dataclass, field

from titanlite.config_sections.jobs import Eval, FaultTolerance, Generate
from titanlite.config_sections.objectives import (
    DPO,
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    IMPORTANCE_SAMPLING_MODES,
    REWARD_AGGREGATIONS,
    REWARD_SCALINGS,
    RL,
    LoRA,
)
from titanlite.config_sections.options import opt
from titanlite.config_sections.scale import (
    ActivationCheckpoint,
    Checkpoint,
    Compile,
    Float8,
    Metrics,
    Parallelism,
    Plan,
    Profiling,
    Validation,
)
from titanlite.config_sections.training import DataSource, Job, LRScheduler, Model, Optimizer, Training

__all__ = [
    "opt",
    "Job",
    "Model",
    "Optimizer",
    "LRScheduler",
    "DataSource",
    "Training",
    "Parallelism",
    "Metrics",
    "Checkpoint",
    "ActivationCheckpoint",
    "Compile",
    "Float8",
    "Profiling",
    "Validation",
    "Plan",
    "LoRA",
    "DPO",
    "GRPO_LOSS_TYPES",
    "REWARD_SCALINGS",
    "REWARD_AGGREGATIONS",
    "IMPORTANCE_SAMPLING_MODES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "RL",
    "FaultTolerance",
    "Generate",
    "Eval",
    "JobConfig",
]


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    plan: Plan = field(default_factory=Plan)
    lora: LoRA = field(default_factory=LoRA)
    dpo: DPO = field(default_factory=DPO)
    rl: RL = field(default_factory=RL)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    generate: Generate = field(default_factory=Generate)
    eval: Eval = field(default_factory=Eval)
