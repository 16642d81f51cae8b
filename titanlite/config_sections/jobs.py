"""The sections of the other jobs a run meets: [fault_tolerance], [generate], [eval]."""

from dataclasses import dataclass

from titanlite.config_sections.options import opt


@dataclass
class FaultTolerance:
    """Replica groups that survive one another's loss (torchft); the lighthouse address is TORCHFT_LIGHTHOUSE."""

    enable: bool = opt(
        False,
        "this job is one replica group of a fault-tolerant run: gradients are averaged with the other groups through "
        "torchft's lighthouse (TORCHFT_LIGHTHOUSE=http://host:port, from torchft_lighthouse), a lost group is left "
        "behind and a restarted one recovers from a live peer (docs/launching.md)",
    )
    replica_id: int = opt(
        0, "this replica group's index, 0 to group_size - 1; a restarted group keeps its id", at_least=0
    )
    group_size: int = opt(
        1, "the number of replica groups; each reads its own share of every step's global batch", at_least=1
    )
    min_replica_size: int = opt(
        1,
        "a step commits only when at least this many groups took part in it; fewer and the step is not applied",
        at_least=1,
    )
    process_group: str = opt(
        "auto",
        "the collective library between groups: auto (nccl on CUDA, gloo on the CPU), gloo or nccl",
        choices=("auto", "gloo", "nccl"),
    )
    process_group_timeout_ms: int = opt(
        10000,
        "a collective between groups, a quorum or a state transfer that takes longer than this is a failure: the step "
        "is not applied and the next quorum leaves the slow group out",
        at_least=1,
    )
    quorum_timeout_seconds: int = opt(
        60,
        "the longest a group waits for a quorum (the first: job.init_timeout_seconds); the request is sent again every "
        "5 s meanwhile, so a lighthouse restarted at the same address is reached; none in time, the group saves its "
        "last committed step and stops, naming the lighthouse",
        at_least=1,
    )
    semi_sync_method: str = opt(
        "none",
        "none: the groups average every step's gradients; diloco: each group trains sync_steps steps alone, then the "
        "groups average how far their weights moved (the pseudo-gradient) and apply it with an outer Nesterov SGD "
        "(DiLoCo, torchft.local_sgd), for groups joined by slow links",
        choices=("none", "diloco"),
    )
    sync_steps: int = opt(
        20,
        "diloco: the steps each group trains alone between two synchronizations; checkpoint.interval and "
        "training.steps must be multiples of it",
        at_least=1,
    )
    outer_lr: float = opt(
        0.7,
        "diloco: the outer SGD's learning rate on the averaged pseudo-gradient (1 with outer_momentum 0 is plain "
        "weight averaging)",
        above=0,
    )
    outer_momentum: float = opt(0.9, "diloco: the outer SGD's Nesterov momentum; 0 = none", at_least=0, below=1)


@dataclass
class Generate:
    prompt: str = opt("", "text to continue (python -m titanlite.generate); empty = the prompts of prompts_file")
    prompts_file: str = opt(
        "",
        'JSON-lines file of prompts, one per line: {"prompt": text}, {"messages": [...]} (the chat template applied '
        'with the generation prompt) or {"token_ids": [...]}',
    )
    checkpoint: str = opt(
        "",
        "a DCP step folder (<dump_folder>/checkpoint/step-N) to take the weights from; empty = as training finds them "
        "(the newest or checkpoint.load_step checkpoint of job.dump_folder when checkpoint.enable, else "
        "checkpoint.initial_load_path or the model.hf_assets_path folder)",
    )
    max_new_tokens: int = opt(128, "tokens generated at most per prompt", at_least=1)
    temperature: float = opt(0.0, "sampling temperature; 0 = greedy (the most likely token each time)", at_least=0)
    top_p: float = opt(
        1.0,
        "sample from the smallest set of most likely tokens whose probabilities reach top_p; 1 = all",
        above=0,
        at_most=1,
    )
    top_k: int = opt(0, "sample from the k most likely tokens only; 0 = all", at_least=0)
    seed: int = opt(
        0,
        "seed of the sampling; the same seed, prompts and weights give the same completions",
        at_least=0,
        at_most=2**32 - 1,
    )
    min_new_tokens: int = opt(
        0,
        "the stop tokens cannot end a completion before this many new tokens (transformers' min_new_tokens)",
        at_least=0,
    )
    ignore_eos: bool = opt(
        False,
        "the stop tokens end nothing: every completion runs to max_new_tokens (or a stop string), as benchmarks need",
    )
    stop: list[str] = opt(
        [],
        "strings that end a completion (cut off before them); generation also ends at the tokenizer's eos and "
        "end-of-turn tokens",
    )
    batch_size: int = opt(8, "prompts generated together (left-padded to the longest of them)", at_least=1)
    compile: bool = opt(
        False,
        "torch.compile the decode step (CPU inductor with frozen weights, or CUDA): faster from the second batch of a "
        "shape on, after a compile of tens of seconds",
    )
    output: str = opt(
        "",
        'JSON-lines file written with one {"prompt", "completion", "token_ids"} per prompt (token_ids: the new tokens '
        "only); empty = stdout",
    )


@dataclass
class Eval:
    tasks: list[str] = opt(
        [],
        "lm-eval task or group names to evaluate the model on while it trains (e.g. hellaswag,arc_easy); scalars "
        "eval/<task>/<metric> go to TensorBoard and the console",
    )
    include_path: str = opt(
        "", "folder of extra lm-eval task YAML files (local tasks); empty = lm-eval's own tasks only"
    )
    limit: int = opt(-1, "at most this many examples per task; -1 = all", at_least=1, sentinels=(-1,))
    num_fewshot: int = opt(
        -1, "few-shot examples in each prompt; -1 = each task's own default", at_least=0, sentinels=(-1,)
    )
    batch_size: int = opt(8, "sequences per forward while evaluating", at_least=1)
    interval: int = opt(0, "evaluate every this many steps; 0 = never during the run", at_least=0)
    at_end: bool = opt(False, "also evaluate after the last step")
    sample_prompts: str = opt(
        "",
        "JSON-lines prompts file (as generate.prompts_file) whose greedy completions go to TensorBoard's text tab at "
        "each evaluation",
    )
    max_new_tokens: int = opt(64, "tokens generated at most for each of sample_prompts", at_least=1)
