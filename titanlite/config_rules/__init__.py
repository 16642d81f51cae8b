"""Rules between keys, one function per section, checked by the loader once every value is in its range.

Only pure config rules live here; checks that need facts of the run (the world size, CUDA, the
tokenizer's vocabulary, the model's context) stay where those facts are known.
"""

from titanlite.config_rules.objectives import check_dpo, check_generate, check_rl
from titanlite.config_rules.training import (
    SINGLE_STAGE_SCHEDULES,
    check_activation_checkpoint,
    check_checkpoint,
    check_context_parallel,
    check_dataset_format,
    check_eval,
    check_fault_tolerance,
    check_lora,
    check_loss_chunking,
    check_model,
    check_multi_token_prediction,
    check_optimizer,
    check_parallelism,
    check_training,
)
from titanlite.config_sections import JobConfig

__all__ = ["SINGLE_STAGE_SCHEDULES", "check_context_parallel", "check_rules"]


def check_rules(cfg: JobConfig) -> None:
    check_optimizer(cfg)
    check_multi_token_prediction(cfg)
    check_training(cfg)
    check_model(cfg)
    check_activation_checkpoint(cfg)
    check_parallelism(cfg)
    check_loss_chunking(cfg)
    check_dataset_format(cfg)
    check_checkpoint(cfg)
    check_lora(cfg)
    check_fault_tolerance(cfg)
    check_eval(cfg)
    check_dpo(cfg)
    check_rl(cfg)
    check_generate(cfg)
