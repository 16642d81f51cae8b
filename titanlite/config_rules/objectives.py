"""Rules between the keys of the objectives and jobs beside training: DPO, GRPO (rewards, off-policy correction,
tools), generation."""

import dataclasses

from titanlite.config_sections import JobConfig
from titanlite.errors import UserError


def refuse_section_keys(section: str, values, dataset_format: str) -> None:
    """An objective's section with a key set away from its default, in a job that trains another objective."""
    changed = [f.name for f in dataclasses.fields(values) if getattr(values, f.name) != getattr(type(values)(), f.name)]
    if changed:
        raise UserError(
            f"{section}.{changed[0]} applies to training.dataset_format {dataset_format} only; set that format "
            f"or leave the [{section}] keys at their defaults"
        )


def refuse_degrees(cfg: JobConfig, keys: tuple[str, ...], objective: str, why: str, instead: str) -> None:
    for key in keys:
        degree = getattr(cfg.parallelism, key)
        if degree > 1:
            raise UserError(
                f"training.dataset_format {objective} with parallelism.{key} {degree} is not supported yet "
                f"({why}); set it to 1 and use {instead}"
            )


DPO_UNSUPPORTED_DEGREES = ("pipeline_parallel_degree", "context_parallel_degree")


def check_dpo(cfg: JobConfig) -> None:
    """[dpo] trains on preference data only; its step runs the reference and the policy on whole sequences of one
    model (no pipeline stages, no sequence shards), and validation measures the plain next-token loss."""
    dpo = cfg.dpo
    if cfg.training.dataset_format != "preference":
        refuse_section_keys("dpo", dpo, "preference")
        return
    refuse_degrees(
        cfg,
        DPO_UNSUPPORTED_DEGREES,
        "preference (DPO)",
        "a pair's log-probabilities are summed over whole sequences on one model",
        "FSDP or tensor parallelism",
    )
    if dpo.loss_type == "ipo" and dpo.label_smoothing:
        raise UserError(
            f"dpo.label_smoothing {dpo.label_smoothing} applies to dpo.loss_type sigmoid only; set it to 0 or "
            "use loss_type sigmoid"
        )
    if cfg.validation.enable:
        raise UserError(
            "validation.enable measures the next-token loss, which means nothing for training.dataset_format "
            "preference (DPO) yet; set validation.enable false"
        )


RL_UNSUPPORTED_DEGREES = ("pipeline_parallel_degree", "context_parallel_degree")


def check_off_policy(rl) -> None:
    """rl.importance_sampling's bounds: an ordered range, and set only where the correction is on."""
    if rl.importance_sampling == "none":
        for key, value, default in (
            ("clip_max", rl.importance_sampling_clip_max, 3.0),
            ("clip_min", rl.importance_sampling_clip_min, -1.0),
        ):
            if value != default:
                raise UserError(
                    f"rl.importance_sampling_{key} {value:g} bounds a correction that rl.importance_sampling "
                    "none leaves off; choose a mode such as rl.importance_sampling sequence_mask or drop the key"
                )
    if rl.loss_type == "vespo" and rl.importance_sampling.startswith("sequence"):
        raise UserError(
            f"rl.loss_type vespo folds the sampler's correction into its weights token by token, which "
            f"rl.importance_sampling {rl.importance_sampling} does not give; use token_truncate or token_mask"
        )
    if rl.importance_sampling_clip_min != -1 and rl.importance_sampling_clip_min >= rl.importance_sampling_clip_max:
        raise UserError(
            f"rl.importance_sampling_clip_min {rl.importance_sampling_clip_min:g} must be below "
            f"rl.importance_sampling_clip_max {rl.importance_sampling_clip_max:g}; lower it or raise the maximum"
        )


def check_tools(rl) -> None:
    """The tool-calling keys (rl/episode.py) need tools."""
    if not rl.tools and not rl.environment:
        for key, value, default in (
            ("max_tool_calling_iterations", rl.max_tool_calling_iterations, -1),
            ("tool_timeout_seconds", rl.tool_timeout_seconds, 10.0),
        ):
            if value != default:
                raise UserError(
                    f"rl.{key} {value:g} applies to tool calls, but neither rl.tools nor rl.environment is "
                    "set; give the model tools or drop the key"
                )


def check_generator_ranks(cfg: JobConfig) -> None:
    """rl.generator_ranks (rl/generator.py): single-turn rollouts of whole policies, one trainer's request per batch."""
    rl = cfg.rl
    if not rl.generator_ranks:
        return
    if rl.tools or rl.environment:
        key = "rl.tools" if rl.tools else "rl.environment"
        raise UserError(
            f"rl.generator_ranks {rl.generator_ranks} with {key} is not built (the agents' episodes run on the "
            "trainers); set rl.generator_ranks 0"
        )
    if cfg.parallelism.tensor_parallel_degree > 1:
        raise UserError(
            f"rl.generator_ranks {rl.generator_ranks} with parallelism.tensor_parallel_degree "
            f"{cfg.parallelism.tensor_parallel_degree} is not built (a TP group's ranks would each ask for the same "
            "completions); use FSDP or HSDP for the trainers, or set rl.generator_ranks 0"
        )


def check_rl(cfg: JobConfig) -> None:
    """[rl] trains on prompts only; its rollouts are generated by copies of the policy (gathered from FSDP, HSDP or
    EP, TP's shards kept), the whole completion of a row on one rank or TP group, and its step's batch is whole groups
    of completions."""
    rl, training = cfg.rl, cfg.training
    if training.dataset_format != "prompts":
        refuse_section_keys("rl", rl, "prompts")
        return
    refuse_degrees(
        cfg,
        RL_UNSUPPORTED_DEGREES,
        "prompts (GRPO)",
        "the rollouts are decoded with every layer and the whole sequence on each rank",
        "FSDP, HSDP, TP or EP",
    )
    if not rl.reward_functions and not rl.environment:
        raise UserError(
            'training.dataset_format prompts needs rl.reward_functions, e.g. ["titanlite.rewards:math_answer"]; '
            "set it (docs/rewards.md)"
        )
    if rl.reward_weights and not any(rl.reward_weights) and not rl.environment and not rl.entropy_coef:
        raise UserError(
            "rl.reward_weights are all 0, so every reward and advantage is 0 and no step can ever train; give "
            "at least one reward function a weight that is not 0"
        )
    if training.global_batch_size == -1 or training.global_batch_size % rl.num_generations:
        raise UserError(
            f"training.global_batch_size ({training.global_batch_size}) counts completions under GRPO and must "
            f"be a multiple of rl.num_generations {rl.num_generations}; set it to prompts per step x "
            f"{rl.num_generations}"
        )
    if rl.reference != "initial" and rl.beta == 0:
        raise UserError(
            f"rl.reference {rl.reference} is used only with rl.beta above 0 (the KL penalty); set rl.beta or "
            "leave rl.reference initial"
        )
    if training.epochs:
        raise UserError(
            "training.epochs counts passes over windows, not prompts; under GRPO set training.steps instead"
        )
    if not training.packing:
        raise UserError(
            "training.packing false means nothing under training.dataset_format prompts (GRPO), whose rows "
            "each hold one prompt and its completion, never packed; leave training.packing at its default"
        )
    check_off_policy(rl)
    if rl.max_staleness and rl.num_iterations > 1:
        raise UserError(
            f"rl.max_staleness {rl.max_staleness} samples each step's rollouts ahead for one update, so "
            f"rl.num_iterations {rl.num_iterations} cannot reuse them; set rl.num_iterations 1 or "
            "rl.max_staleness 0"
        )
    check_tools(rl)
    check_generator_ranks(cfg)
    if cfg.validation.enable or cfg.fault_tolerance.enable:
        key = "validation.enable" if cfg.validation.enable else "fault_tolerance.enable"
        raise UserError(f"{key} is not supported with training.dataset_format prompts (GRPO) yet; set it to false")


def check_generate(cfg: JobConfig) -> None:
    generate = cfg.generate
    if generate.min_new_tokens > generate.max_new_tokens:
        raise UserError(
            f"generate.min_new_tokens {generate.min_new_tokens} passes generate.max_new_tokens "
            f"{generate.max_new_tokens}; lower it or raise generate.max_new_tokens"
        )
