"""GRPO (training.dataset_format prompts, [rl]) on the debug model: the rollouts written to rollouts.jsonl carry TRL's
group advantages of their rewards and end with their stop token; the rl/* scalars and the step line's reward; a resume
inside a rollout batch's updates trains on the very same rows as an uninterrupted run; 2 FSDP ranks equal one process;
LoRA's reference is the base with its adapters off; errors are one sentence. The loss and advantage formulas are
tested against TRL in test_grpo_loss.py, the reward functions in test_rewards.py."""

import json
import shutil

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU, run_test_script, tensorboard_scalars

from titanlite.train import main

LETTERS = "tests/grpo_rewards.py:letter_share"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Question {i}: say eeee", "answer": str(i)}) + "\n" for i in range(12))
    )
    return path


def grpo_flags(prompts, dump, steps, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.dataset_format",
        "prompts",
        "--training.dataset_path",
        str(prompts),
        "--training.seq_len",
        "48",
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "8",
        "--rl.num_generations",
        "4",
        "--rl.max_new_tokens",
        "12",
        "--rl.reward_functions",
        LETTERS,
        "--training.mixed_precision_param",
        "float32",
        "--lr_scheduler.warmup_steps",
        "0",
        "--optimizer.lr",
        "0.003",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        *map(str, extra),
    ]


def rollouts(dump) -> list[dict]:
    return [json.loads(line) for line in (dump / "rollouts.jsonl").read_text().splitlines()]


def test_rollouts_carry_group_advantages_and_the_scalars_are_written(prompts, tmp_path, capsys):
    assert main(grpo_flags(prompts, tmp_path, 2, "--rl.log_rollouts", "--rl.beta", "0.1", "--rl.log_completions")) == 0
    lines = rollouts(tmp_path)
    assert [line["step"] for line in lines] == [1] * 8 + [2] * 8
    for group in range(4):  # 2 steps x 2 prompts x 4 completions
        rows = lines[4 * group : 4 * group + 4]
        assert len({tuple(row["prompt_ids"]) for row in rows}) == 1
        rewards = torch.tensor([row["rewards"]["letter_share"] for row in rows])
        assert [row["reward"] for row in rows] == pytest.approx(rewards.tolist())
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        assert [row["advantage"] for row in rows] == pytest.approx(expected.tolist(), abs=1e-5)
    for row in lines:  # as sampled: a completion shorter than max_new_tokens ends with its stop token
        assert len(row["completion_ids"]) <= 12 and len(row["logprobs"]) == len(row["completion_ids"])
        assert row["policy_step"] == row["step"] - 1 and row["prompt"].startswith("Question ")
        assert isinstance(row["completion"], str)
    scalars = {
        tag: tensorboard_scalars(tmp_path / "tb", tag)
        for tag in (
            "rl/reward",
            "rl/reward/letter_share",
            "rl/reward_std",
            "rl/kl",
            "rl/clip_ratio",
            "rl/entropy",
            "rl/completion_length",
            "rl/frac_reward_zero_std",
            "rl/generate_seconds",
        )
    }
    assert all(sorted(values) == [1, 2] for values in scalars.values()), scalars
    step_one = [row["reward"] for row in lines[:8]]
    assert scalars["rl/reward"][1] == pytest.approx(sum(step_one) / 8, abs=1e-6)
    assert scalars["rl/kl"][1] == pytest.approx(0.0, abs=1e-7)  # the reference is the starting policy
    assert scalars["rl/completion_length"][1] == pytest.approx(sum(len(r["completion_ids"]) for r in lines[:8]) / 8)
    err = capsys.readouterr().err
    assert f"reward: {scalars['rl/reward'][2]:.4f}" in err
    assert "data: 0.0%" in err  # generating is timed as rl/generate_seconds, not as waiting for data
    shown = lines[8]  # rl.log_completions: rank 0's first completions of each logged step, as text
    assert f"step 2 completion (reward {shown['reward']:.4f}): {shown['prompt']!r} -> {shown['completion']!r}" in err


def test_a_resume_inside_a_rollout_batch_trains_on_the_same_rows(prompts, tmp_path):
    """num_iterations 2: the checkpoint at step 3 holds the rollouts that step 4 trains on again."""
    flags = [
        "--rl.num_iterations",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.last_save_model_only",
        "false",
        "--rl.log_rollouts",
    ]
    assert main(grpo_flags(prompts, tmp_path / "whole", 5, *flags)) == 0
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    # the log as a run stopped after step 5's rollouts: its lines after the checkpoint are not kept twice
    shutil.copy(tmp_path / "whole" / "rollouts.jsonl", tmp_path / "resumed" / "rollouts.jsonl")
    assert main(grpo_flags(prompts, tmp_path / "resumed", 5, *flags)) == 0
    whole, resumed = (tensorboard_scalars(tmp_path / run / "tb", "loss/train") for run in ("whole", "resumed"))
    assert sorted(resumed) == [4, 5] and all(resumed[s] == pytest.approx(whole[s], abs=1e-6) for s in (4, 5))
    assert rollouts(tmp_path / "resumed") == rollouts(tmp_path / "whole")
    assert [row["step"] for row in rollouts(tmp_path / "whole")] == [1] * 8 + [3] * 8 + [5] * 8


def test_two_fsdp_ranks_tensor_and_expert_parallel_2_equal_one_process(prompts, tmp_path):
    """The same 2 prompts x 4 completions per step: one process (accumulating 2 micro-batches) and 2 FSDP ranks, whose
    rollouts are decoded by a copy of the weights gathered once per rollout batch. On-policy in fp32 the sampler's
    log-probabilities equal the trainer's within 1e-5 on both: every importance-sampling ratio is 1 within 1e-5.
    With rl.max_staleness 1 (rollouts decoded on the engine's thread from a copy, one update back) too; under
    tensor parallelism 2 (one data-parallel rank: both TP ranks decode the same completions together, each with its
    own heads' weights and keys and values, and train on them with the vocabulary-sharded logits gathered); and for
    Qwen3's MoE under expert parallelism 2 (2 FSDP ranks, 4 experts each, decoding a copy with every expert
    gathered): the same completions, rewards and losses (within 1e-5). The runs
    take TRL 1.16's other loss terms too (rl/loss_family.py): the top-entropy mask, whose threshold is one per step over
    every rank's tokens (a TP group counted once), the entropy bonus, sapo at sequence level, GDPO's aggregation."""
    flags = [
        "--rl.log_rollouts",
        "--rl.loss_type",
        "grpo",
        "--rl.beta",
        "0.05",
        "--rl.num_iterations",
        "2",
        "--rl.importance_sampling",
        "token_truncate",
        "--rl.top_entropy_quantile",
        "0.5",
        "--rl.entropy_coef",
        "0.01",
    ]
    stale = [
        "--rl.log_rollouts",
        "--rl.max_staleness",
        "1",
        "--rl.importance_sampling",
        "sequence_mask",
        "--rl.loss_type",
        "sapo",
        "--rl.importance_sampling_level",
        "sequence",
        "--rl.multi_objective_aggregation",
        "normalize_then_sum",
    ]
    assert main(grpo_flags(prompts, tmp_path / "one", 3, *flags)) == 0
    assert main(grpo_flags(prompts, tmp_path / "one_stale", 3, *stale)) == 0
    moe = ["--model.name", "qwen3_moe", *flags]
    assert main(grpo_flags(prompts, tmp_path / "one_moe", 3, *moe)) == 0
    spec = tmp_path / "runs.json"
    spec.write_text(
        json.dumps(
            [
                {"argv": grpo_flags(prompts, tmp_path / "fsdp", 3, *flags)},
                {"argv": grpo_flags(prompts, tmp_path / "fsdp_stale", 3, *stale)},
                {"argv": grpo_flags(prompts, tmp_path / "tp", 3, *flags, "--parallelism.tensor_parallel_degree", "2")},
                {"argv": grpo_flags(prompts, tmp_path / "ep", 3, *moe, "--parallelism.expert_parallel_degree", "2")},
            ]
        )
    )
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for one_run, fsdp_run, kl in (
        ("one", "fsdp", ("rl/kl",)),
        ("one_stale", "fsdp_stale", ()),
        ("one", "tp", ("rl/kl",)),
        ("one_moe", "ep", ("rl/kl",)),
    ):
        for tag in ("loss/train", "rl/reward", "rl/entropy", *kl):
            one, fsdp = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in (one_run, fsdp_run))
            assert sorted(fsdp) == [1, 2, 3] and all(fsdp[s] == pytest.approx(one[s], abs=1e-5) for s in one), (
                tag,
                one,
                fsdp,
            )
        one, fsdp = rollouts(tmp_path / one_run), rollouts(tmp_path / fsdp_run)
        assert [r["completion_ids"] for r in fsdp] == [r["completion_ids"] for r in one]
        assert [r["reward"] for r in fsdp] == [r["reward"] for r in one]
    for run in ("one", "fsdp", "tp", "one_moe", "ep"):
        low, high = (tensorboard_scalars(tmp_path / run / "tb", f"rl/sampling/ratio_{end}") for end in ("min", "max"))
        assert all(1 - 1e-5 <= low[s] <= high[s] <= 1 + 1e-5 for s in (1, 2, 3)), (run, low, high)


def test_lora_grpo_keeps_the_base_as_its_reference(prompts, tmp_path, capsys):
    lora = [
        "--lora.rank",
        "4",
        "--lora.target_modules",
        "wq,wv",
        "--rl.beta",
        "0.1",
        "--optimizer.lr",
        "0.02",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
    ]
    assert main(grpo_flags(prompts, tmp_path, 3, *lora)) == 0
    assert "GRPO reference: the LoRA base with its adapters switched off (no second copy)" in capsys.readouterr().err
    kl = tensorboard_scalars(tmp_path / "tb", "rl/kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-7) and kl[3] > 0  # the adapters moved the policy off its base
    exported = tmp_path / "checkpoint"  # the policy exported as after SFT: merged weights and the PEFT adapters
    assert (exported / "step-3-hf" / "config.json").is_file() and (
        exported / "step-3-peft" / "adapter_config.json"
    ).is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.reward_functions", ""], "training.dataset_format prompts needs rl.reward_functions"),
        (["--training.global_batch_size", "6"], "training.global_batch_size (6) counts completions under GRPO"),
        (
            ["--parallelism.pipeline_parallel_degree", "2"],
            "with parallelism.pipeline_parallel_degree 2 is not supported yet",
        ),
        (["--rl.reward_functions", "tests/grpo_rewards.py:wrong_length"], "wrong_length"),
        (["--rl.max_new_tokens", "64"], "raise training.seq_len or lower rl.max_new_tokens"),
        (["--training.packing", "false"], "training.packing false means nothing under training.dataset_format prompts"),
        (["--rl.importance_sampling_clip_max", "2"], "rl.importance_sampling_clip_max 2 bounds a correction that"),
        (
            ["--rl.importance_sampling", "token_mask", "--rl.importance_sampling_clip_min", "3"],
            "rl.importance_sampling_clip_min 3 must be below rl.importance_sampling_clip_max 3",
        ),
        (["--rl.importance_sampling", "coin"], "rl.importance_sampling"),
        (
            ["--rl.reward_weights", "0"],
            "rl.reward_weights are all 0, so every reward and advantage is 0 and no step can",
        ),
        (
            ["--rl.loss_type", "vespo", "--rl.importance_sampling", "sequence_mask"],
            "rl.loss_type vespo folds the sampler's",
        ),
        (["--rl.top_entropy_quantile", "1.5"], "rl.top_entropy_quantile"),
        (["--rl.off_policy_mask_threshold", "-0.5"], "rl.off_policy_mask_threshold"),
    ],
)
def test_errors_are_one_sentence_exit_2(prompts, tmp_path, capsys, extra, message):
    assert main(grpo_flags(prompts, tmp_path, 1, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_rollouts_log_that_cannot_be_written_stops_the_run_before_any_rollout(prompts, tmp_path, capsys):
    (tmp_path / "rollouts.jsonl").mkdir()
    assert main(grpo_flags(prompts, tmp_path, 1, "--rl.log_rollouts")) == 2
    err = capsys.readouterr().err
    assert f"rl.log_rollouts writes {tmp_path / 'rollouts.jsonl'}, which cannot be written" in err
    assert "Traceback" not in err and "step: 1" not in err


def test_a_step_that_trains_nothing_says_why(prompts, tmp_path, capsys):
    """TRL's warnings: no completion scored (every reward None), or every completion masked as truncated."""
    assert (
        main(grpo_flags(prompts, tmp_path / "unscored", 2, "--rl.reward_functions", "tests/rl_rewards.py:never_scores"))
        == 0
    )
    err = capsys.readouterr().err
    assert all(f"step {s}: every reward function returned None for every completion" in err for s in (1, 2))
    assert (
        main(
            grpo_flags(
                prompts,
                tmp_path / "masked",
                1,
                "--rl.max_new_tokens",
                "1",
                "--rl.mask_truncated_completions",
                "--rl.temperature",
                "0.01",
            )
        )
        == 0
    )
    assert "step 1: rl.mask_truncated_completions left out every completion" in capsys.readouterr().err


def test_rl_keys_apply_to_prompts_only(tmp_path, capsys):
    assert (
        main([*ON_CPU, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--rl.beta", "0.1"]) == 2
    )
    assert "rl.beta applies to training.dataset_format prompts only" in capsys.readouterr().err


def test_record_fields_reach_the_reward_functions(prompts, tmp_path):
    assert (
        main(
            grpo_flags(
                prompts, tmp_path, 1, "--rl.reward_functions", "tests/grpo_rewards.py:by_answer", "--rl.log_rollouts"
            )
        )
        == 0
    )
    lines = rollouts(tmp_path)
    assert all(line["rewards"]["by_answer"] in (0.0, 1.0) for line in lines)
    assert (
        main(
            grpo_flags(
                prompts, tmp_path, 1, "--rl.reward_functions", "tests/grpo_rewards.py:by_answer", "--rl.log_rollouts"
            )
        )
        == 0
    )
    assert rollouts(tmp_path) == lines  # a new run in the folder: the log is its own, not appended to the last one's


@pytest.mark.extended
def test_compiled_blocks_train_as_eager_and_decode_the_same_rollouts(prompts, tmp_path):
    """compile.enable: the rollouts decode through the compiled blocks eagerly (compiled, every cache length was a
    recompile, past dynamo's limit); training runs them compiled."""
    assert main(grpo_flags(prompts, tmp_path / "eager", 2, "--rl.log_rollouts")) == 0
    assert main(grpo_flags(prompts, tmp_path / "compiled", 2, "--rl.log_rollouts", "--compile.enable")) == 0
    compiled, eager = rollouts(tmp_path / "compiled"), rollouts(tmp_path / "eager")
    # the same completions and rewards; the sampler's log-probabilities of step 2 come from weights one compiled
    # (or eager) update moved, which round alike only to fp32's last bits
    for line in eager:
        line["logprobs"] = pytest.approx(line["logprobs"], abs=1e-5)
    assert compiled == eager
    eager, compiled = (tensorboard_scalars(tmp_path / run / "tb", "loss/train") for run in ("eager", "compiled"))
    assert all(compiled[s] == pytest.approx(eager[s], abs=1e-5) for s in (1, 2))


@pytest.mark.extended
def test_a_dense_toy_reward_rises_within_tens_of_steps(prompts, tmp_path):
    """The share of the letter e in 16-token completions of the debug model, 2 prompts x 8 completions a step, 30
    steps."""
    flags = [
        "--training.local_batch_size",
        "16",
        "--training.global_batch_size",
        "16",
        "--rl.num_generations",
        "8",
        "--rl.max_new_tokens",
        "16",
        "--training.seq_len",
        "64",
        "--metrics.log_freq",
        "1",
    ]
    assert main(grpo_flags(prompts, tmp_path, 30, *flags)) == 0
    reward = tensorboard_scalars(tmp_path / "tb", "rl/reward")
    first, last = (sum(reward[s] for s in steps) / 5 for steps in (range(1, 6), range(26, 31)))
    assert last > first + 0.03, reward  # measured: 0.119 over steps 1-5, 0.170 over steps 26-30
