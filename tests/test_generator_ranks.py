"""rl.generator_ranks (rl/generator.py): 1 trainer + 1 generator rank give the 1-process colocated run, bit for bit, at
rl.max_staleness 0 and 1 (losses, rewards, rollouts.jsonl with the sampler's log-probabilities), the weights' sync is
timed (rl/weight_sync_seconds), and what it cannot serve is refused in one sentence with exit 2."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, ROOT, run_test_script, tensorboard_scalars, with_root_on_path
from test_grpo import grpo_flags, prompts, rollouts  # noqa: F401
from test_rl_preemption import FLAGS

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


@pytest.mark.extended
def test_a_resume_on_generator_ranks_with_rollouts_in_flight_is_the_same_run(prompts, tmp_path):
    """K = 1, a checkpoint at step 2 holding step 3's rollouts: the resumed run (the generator holding no weights
    until trainer 0 sends the loaded ones) trains steps 3 and 4 as the uninterrupted run does."""
    save = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    flags = [*STALE, *save, "--rl.log_rollouts", "--rl.generator_ranks", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    runs = [
        {"argv": grpo_flags(prompts, whole, 4, *flags)},
        {"argv": grpo_flags(prompts, resumed, 4, *flags), "resume_from": str(whole / "checkpoint" / "step-2")},
    ]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for tag in ("loss/train", "optim/grad_norm", "rl/reward"):
        expected, got = (tensorboard_scalars(run / "tb", tag) for run in (whole, resumed))
        assert sorted(got) == [3, 4] and all(got[s] == expected[s] for s in got), tag
    assert rollouts(resumed) == [line for line in rollouts(whole) if line["step"] > 2]


@pytest.mark.extended
def test_two_fsdp_trainers_and_two_generator_ranks_give_the_colocated_run(prompts, tmp_path):
    """4 processes: 2 trainers (FSDP) send their requests to generator 0 and 1 respectively; trainer 0 broadcasts
    the gathered weights to both."""
    assert main(grpo_flags(prompts, tmp_path / "colocated", 3, "--rl.log_rollouts")) == 0
    flags = grpo_flags(prompts, tmp_path / "generators", 3, "--rl.log_rollouts", "--rl.generator_ranks", "2")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([{"argv": flags}]))
    out = run_test_script("layout_runs.py", str(spec), nproc=4, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for tag in ("loss/train", "rl/reward"):
        expected, got = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("colocated", "generators"))
        assert sorted(got) == [1, 2, 3] and all(got[s] == pytest.approx(expected[s], abs=1e-5) for s in got), tag
    colocated, generators = rollouts(tmp_path / "colocated"), rollouts(tmp_path / "generators")
    assert [r["completion_ids"] for r in generators] == [r["completion_ids"] for r in colocated]


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


@pytest.mark.extended
def test_sigterm_during_a_rollout_on_a_generator_rank_saves_the_last_step_and_every_rank_exits_0(tmp_path):
    """SIGTERM to both ranks (as Slurm or Kubernetes sends it) while the generator decodes step 2's long rollout:
    the trainer stops waiting, saves step 1 and ends the run; the generator's decode stops at its next token."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: say eeee"}) + "\n" for i in range(12)))
    flags = [*FLAGS, "--training.dataset_path", str(prompts), "--job.dump_folder", str(tmp_path / "run")]
    log = tmp_path / "log.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [*command, "-m", "titanlite.train", *flags, "--training.steps", "3", "--rl.generator_ranks", "1"],
            cwd=ROOT,
            stderr=out,
            stdout=out,
            env=with_root_on_path(),
        )
        while "step: 1 " not in log.read_text():
            assert launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        ranks = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(ranks) == 2
        for rank in ranks:
            os.kill(int(rank), signal.SIGTERM)
        signalled = time.perf_counter()
        assert launcher.wait(timeout=60) == 0, log.read_text()[-3000:]
    took = time.perf_counter() - signalled
    text = log.read_text()
    assert "stopped at step 1 on SIGTERM; exiting" in text and "step: 2 " not in text
    assert took < 15, f"{took:.1f} s from SIGTERM to exit"
    assert (tmp_path / "run" / "checkpoint" / "step-1").is_dir()
