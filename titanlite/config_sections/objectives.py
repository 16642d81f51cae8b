"""The sections of fine-tuning objectives: [lora], [dpo], [rl], and the [rl] choices, spelled once (the rl/ modules
that compute them import these)."""

from dataclasses import dataclass

from titanlite.config_sections.options import opt


@dataclass
class LoRA:
    rank: int = opt(
        0,
        "rank of the low-rank adapters added to the target layers, whose own weights are then frozen; 0 = no LoRA "
        "(every weight trains)",
        at_least=0,
    )
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / rank", above=0)
    dropout: float = opt(0.0, "dropout on the adapters' input while training", at_least=0, below=1)
    target_modules: list[str] = opt(
        ["wq", "wk", "wv", "wo"],
        "the linear layers that get adapters, by their name in the model (attention: wq,wk,wv,wo; MLP: w1,w2,w3; the "
        "output layer: output)",
    )
    base_dtype: str = opt(
        "float32",
        "dtype the frozen linear weights are kept in; bfloat16 halves their memory and changes no result, since with "
        "training.mixed_precision_param bfloat16 (required) they compute in bfloat16 anyway (embeddings and norms stay "
        "float32)",
        choices=("float32", "bfloat16"),
    )


@dataclass
class DPO:
    """Direct preference optimization, for training.dataset_format preference (titanlite/objectives/dpo.py)."""

    beta: float = opt(
        0.1,
        "a completion's reward is beta x (its log-probability under the policy - under the reference), "
        "log-probabilities summed over its trained tokens; a higher beta keeps the policy nearer the reference",
        above=0,
    )
    loss_type: str = opt(
        "sigmoid",
        "sigmoid (the DPO paper: -log sigmoid of the chosen reward minus the rejected one) or ipo (IPO: the squared "
        "distance of the log-ratio margin, with log-probabilities averaged over the completion's tokens as TRL does, "
        "from 1 / (2 beta))",
        choices=("sigmoid", "ipo"),
    )
    label_smoothing: float = opt(
        0.0,
        "loss_type sigmoid: the assumed share of pairs whose chosen and rejected are swapped (conservative DPO); 0 = "
        "none",
        at_least=0,
        below=0.5,
    )
    reference: str = opt(
        "initial",
        "the frozen reference model: initial (the weights training starts from, checkpoint.initial_load_path or "
        "job.seed's; under LoRA the base with the adapters switched off, no second copy) or the path of a Hugging Face "
        "folder or a DCP step folder of the same model (a frozen copy, sharded like the policy)",
    )


# The [rl] choices, spelled once: the rl/ modules that compute them import these.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
REWARD_SCALINGS = ("group", "batch", "none")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_SAMPLING_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class RL:
    """Reinforcement learning with verifiable rewards, for training.dataset_format prompts
    (titanlite/objectives/grpo.py)."""

    num_generations: int = opt(
        8,
        "completions sampled per prompt (the group); training.global_batch_size counts completions and must be a "
        "multiple of it",
        at_least=2,
    )
    max_new_tokens: int = opt(
        256, "tokens generated at most per completion (the prompt and they must fit in training.seq_len)", at_least=1
    )
    temperature: float = opt(
        1.0,
        "sampling temperature of the rollouts; the log-probabilities trained on are those of the logits divided by it, "
        "as sampled",
        above=0,
    )
    top_p: float = opt(
        1.0,
        "sample from the smallest set of most likely tokens whose probabilities reach top_p; 1 = all",
        above=0,
        at_most=1,
    )
    top_k: int = opt(0, "sample from the k most likely tokens only; 0 = all", at_least=0)
    epsilon: float = opt(
        0.2,
        "the probability ratio of a token (policy / the policy that sampled it) is clipped below at 1 - epsilon",
        above=0,
        below=1,
    )
    epsilon_high: float = opt(
        -1.0, "and above at 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); -1 = epsilon", above=0, sentinels=(-1.0,)
    )
    beta: float = opt(
        0.0,
        "weight of the KL penalty against the reference (the k3 estimator); 0 = none and no reference model",
        at_least=0,
    )
    reference: str = opt(
        "initial",
        "with beta above 0, the frozen reference: initial (the weights training starts from; under LoRA the base with "
        "the adapters switched off, no second copy) or the path of a Hugging Face folder or a DCP step folder of the "
        "same model",
    )
    num_iterations: int = opt(
        1,
        "optimizer steps on each batch of rollouts (their old log-probabilities computed once, before the first)",
        at_least=1,
    )
    loss_type: str = opt(
        "dapo",
        "how token losses make the step's loss, with TRL 1.16's meanings: grpo (each completion's mean, averaged), "
        "bnpo and dapo (the sum over the global batch's completion tokens divided by their number: the same here, "
        "where the batch is always the global one), dr_grpo (the sum divided by completions x max_new_tokens), cispo "
        "(the ratio capped at epsilon_high and detached, times the advantage and the log-probability), sapo (a sigmoid "
        "gate of the ratio in place of the clip), luspo (each completion's token sum, averaged: meant for "
        "importance_sampling_level sequence), vespo (a gamma weight of the sequence's ratio times the log-probability)",
        choices=GRPO_LOSS_TYPES,
    )
    importance_sampling_level: str = opt(
        "token",
        "the ratio the loss clips: per token, or sequence (GSPO: the exponent of the mean log-ratio over the "
        "completion)",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    sapo_temperature_neg: float = opt(1.05, "sapo: the gate's temperature where the advantage is not positive", above=0)
    sapo_temperature_pos: float = opt(1.0, "sapo: the gate's temperature where the advantage is positive", above=0)
    vespo_k_pos: float = opt(2.0, "vespo: the power k of the sequence ratio w where the advantage is >= 0", at_least=0)
    vespo_lambda_pos: float = opt(3.0, "vespo: the decay lambda where the advantage is >= 0", at_least=0)
    vespo_k_neg: float = opt(3.0, "vespo: the power k where the advantage is negative", at_least=0)
    vespo_lambda_neg: float = opt(2.0, "vespo: the decay lambda where the advantage is negative", at_least=0)
    entropy_coef: float = opt(
        0.0,
        "entropy bonus: the loss minus this times the mean entropy of the trained tokens (those top_entropy_quantile "
        "keeps); 0 = none",
        at_least=-1000,
        at_most=1000,
    )
    top_entropy_quantile: float = opt(
        1.0,
        "train only this top share of the global batch's completion tokens by entropy (one threshold per step, over "
        "every rank); 1 = all",
        at_least=0,
        at_most=1,
    )
    scale_rewards: str = opt(
        "group",
        "advantages are rewards minus their group's mean, divided by the std of the group, of the whole batch, or by "
        "nothing (none: Dr. GRPO)",
        choices=REWARD_SCALINGS,
    )
    multi_objective_aggregation: str = opt(
        "sum_then_normalize",
        "with several reward functions: sum their weighted rewards, then scale as scale_rewards says; or "
        "normalize_then_sum (GDPO): normalise each function's rewards in its group, sum them weighted, then normalise "
        "over the batch",
        choices=REWARD_AGGREGATIONS,
    )
    reward_functions: list[str] = opt(
        [],
        "reward functions, each path/to/file.py:function or module:function, called as TRL calls them "
        "(docs/rewards.md), e.g. titanlite.rewards:math_answer",
    )
    reward_weights: list[float] = opt(
        [],
        "each reward function's weight in the reward (negative: a penalty); empty = 1 each",
        at_least=-1000,
        at_most=1000,
    )
    mask_truncated_completions: bool = opt(False, "completions cut at max_new_tokens (no eos) are left out of the loss")
    max_staleness: int = opt(
        0,
        "asynchronous rollouts: step s trains on completions sampled by the weights after step max(0, s - 1 - "
        "max_staleness), generated while the steps before it train, on a fixed schedule (a run and its resume are the "
        "same run); 0 = each step samples its own with the current weights",
        at_least=0,
        at_most=16,
    )
    generator_ranks: int = opt(
        0,
        "the last this many ranks of the launch only generate rollouts (each serving its share of the trainers, fed "
        "the new weights after each optimizer step that a rollout needs), the others train; 0 = the trainers generate "
        "(colocated)",
        at_least=0,
        at_most=1024,
    )
    importance_sampling: str = opt(
        "none",
        "off-policy correction of the surrogate by the trainer/sampler probability ratio, with TRL's meanings "
        "(vllm_importance_sampling_mode): per token or per completion (sequence), clamped into the clip range "
        "(truncate) or zeroed outside it (mask); none = no correction (the colocated sampler is the trainer's own "
        "policy)",
        choices=IMPORTANCE_SAMPLING_MODES,
    )
    importance_sampling_clip_max: float = opt(3.0, "rl.importance_sampling's upper bound on the ratio", above=0)
    importance_sampling_clip_min: float = opt(
        -1.0, "rl.importance_sampling's lower bound on the ratio; -1 = none", at_least=0, sentinels=(-1.0,)
    )
    off_policy_mask_threshold: float = opt(
        -1.0,
        "drop a completion with a negative advantage whose mean sampler - trainer log-probability ratio passes this "
        "(DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold); -1 = off",
        at_least=0,
        sentinels=(-1.0,),
    )
    log_rollouts: bool = opt(
        False,
        "write every trained completion (step, policy_step, prompt and completion as text and ids, the sampler's "
        "logprobs, rewards, reward, advantage) to <dump_folder>/rollouts.jsonl, each step once",
    )
    log_completions: bool = opt(
        False,
        "print a few (prompt, completion, reward) of each rollout batch that serves a logged step to the console, as "
        "TRL does",
    )
    tools: list[str] = opt(
        [],
        "tools the model may call (docs/agents.md), each path/to/file.py:function or module:function: typed functions "
        "with Google-style docstrings, given to the chat template as TRL gives them",
    )
    environment: str = opt(
        "",
        "path/to/file.py:Factory (or module:Factory) making one environment per rollout, as TRL's environment_factory: "
        "reset(**record) may add text to the prompt, its public methods are tools, an optional get_reward() is one "
        "more reward (docs/agents.md)",
    )
    max_tool_calling_iterations: int = opt(
        -1,
        "rounds of tool calls answered at most per completion; -1 = as many as rl.max_new_tokens allows (TRL's None)",
        at_least=0,
        sentinels=(-1,),
    )
    tool_timeout_seconds: float = opt(
        10.0,
        "a tool call that has not returned after this long is answered with an error (its thread abandoned)",
        above=0,
    )
