"""rl.generator_ranks (rl/generator.py): 1 trainer + 1 generator rank give the 1-process colocated run, bit for bit, at
rl.max_staleness 0 and 1 (losses, rewards, rollouts.jsonl with the sampler's log-probabilities), the weights' sync is
timed (rl/weight_sync_seconds), and what it cannot serve is refused in one sentence with exit 2."""

import json

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, run_test_script, tensorboard_scalars
from test_grpo import grpo_flags, prompts, rollouts  # noqa: F401

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.rl.generator import check_generator_ranks
from titanlite.train import main

STALE = ["--rl.max_staleness", "1", "--rl.importance_sampling", "token_truncate"]


def test_a_generator_rank_gives_the_colocated_run_at_staleness_0_and_1(prompts, tmp_path):
    runs = {"k0": ["--rl.log_rollouts"], "k1": ["--rl.log_rollouts", *STALE]}
    for name, extra in runs.items():
        assert main(grpo_flags(prompts, tmp_path / f"colocated_{name}", 3, *extra)) == 0
    spec = tmp_path / "runs.json"
    spec.write_text(
        json.dumps(
            [
                {"argv": grpo_flags(prompts, tmp_path / f"generator_{name}", 3, *extra, "--rl.generator_ranks", "1")}
                for name, extra in runs.items()
            ]
        )
    )
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in runs:
        colocated, generator = tmp_path / f"colocated_{name}", tmp_path / f"generator_{name}"
        for tag in ("loss/train", "optim/grad_norm", "rl/reward"):
            expected, got = (tensorboard_scalars(run / "tb", tag) for run in (colocated, generator))
            assert sorted(got) == [1, 2, 3] and got == expected, (name, tag, expected, got)
        assert rollouts(generator) == rollouts(colocated)  # completions, log-probabilities, rewards, policy steps
        synced = tensorboard_scalars(generator / "tb", "rl/weight_sync_seconds")
        assert sorted(synced) == [1, 2, 3] and synced[1] > 0, synced


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.generator_ranks", "1"], "rl.generator_ranks 1 leaves none of the 1 processes to train; launch more"),
        (
            ["--rl.generator_ranks", "1", "--rl.tools", "tests/agent_tools.py:add"],
            "rl.generator_ranks 1 with rl.tools is not built",
        ),
        (
            ["--rl.generator_ranks", "1", "--parallelism.tensor_parallel_degree", "2"],
            "rl.generator_ranks 1 with parallelism.tensor_parallel_degree 2 is not built",
        ),
        (["--rl.generator_ranks", "-1"], "rl.generator_ranks"),
    ],
)
def test_what_generator_ranks_cannot_serve_is_one_sentence_exit_2(prompts, tmp_path, capsys, extra, message):
    assert main(grpo_flags(prompts, tmp_path, 1, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_generator_ranks_without_grpo_is_one_sentence_exit_2(tmp_path, capsys):
    flags = [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(tmp_path),
        "--rl.generator_ranks",
        "1",
    ]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "rl.generator_ranks applies to training.dataset_format prompts only" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (
            ["--parallelism.data_parallel_shard_degree", "2"],
            2,
            "rl.generator_ranks 1 leaves 1 of 2 processes to train: parallelism degrees",
        ),
        (["--rl.generator_ranks", "2"], 3, "rl.generator_ranks 2 is more than the 1 trainer ranks it leaves"),
    ],
)
def test_the_trainers_left_must_hold_the_layout(prompts, tmp_path, extra, world, message):
    cfg = load_config(grpo_flags(prompts, tmp_path, 1, "--rl.generator_ranks", "1", *extra))
    with pytest.raises(UserError, match=message):
        check_generator_ranks(cfg, world)
