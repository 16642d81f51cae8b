"""rl.max_staleness K (titanlite/rl/ahead.py): step s trains on completions sampled by the weights after step
max(0, s - 1 - K), decoded on the engine's thread while earlier steps train; the importance-sampling ratio sees the
staleness (1 on-policy at step 1, off 1 after); a run killed with SIGKILL and resumed from a checkpoint whose rollouts
were in flight is the uninterrupted run, bit for bit, rollouts.jsonl included; a checkpoint of another K is refused in
one sentence."""

import subprocess
import sys
import time

import pytest
from conftest import ROOT, tensorboard_scalars
from test_grpo import grpo_flags, prompts, rollouts  # noqa: F401

from titanlite.train import main


def stale(*extra) -> list[str]:
    return ["--rl.max_staleness", "1", "--rl.log_rollouts", "--rl.importance_sampling", "token_truncate", *extra]


def test_each_step_trains_on_the_weights_k_steps_back_and_a_resume_is_the_same_run(prompts, tmp_path):
    flags = stale("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false")
    assert main(grpo_flags(prompts, tmp_path / "whole", 4, *flags)) == 0
    lines = rollouts(tmp_path / "whole")
    assert [line["step"] for line in lines] == [s for s in (1, 2, 3, 4) for _ in range(8)]  # trained steps, each once
    assert all(line["policy_step"] == max(0, line["step"] - 2) for line in lines)
    low, high = (tensorboard_scalars(tmp_path / "whole" / "tb", f"rl/sampling/ratio_{end}") for end in ("min", "max"))
    assert 1 - 1e-5 <= low[1] <= high[1] <= 1 + 1e-5  # step 1 is on-policy
    assert all(high[s] - low[s] > 1e-4 for s in (2, 3, 4))  # the others were sampled one update back

    resumed = (
        tmp_path / "resumed"
    )  # the same run killed (-9) in step 3, its step-2 checkpoint holding step 3's rollouts
    log = tmp_path / "killed.txt"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "titanlite.train", *grpo_flags(prompts, resumed, 4, *flags)],
            cwd=ROOT,
            stdout=out,
            stderr=out,
        )
        while "step: 3 " not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        process.kill()
        process.wait()
    assert {line["step"] for line in rollouts(resumed)} >= {1, 2, 3}  # lines the resume must not repeat
    assert main(grpo_flags(prompts, resumed, 4, *flags)) == 0
    for tag in ("loss/train", "optim/grad_norm", "rl/reward", "rl/sampling/ratio_max"):
        whole, again = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("whole", "resumed"))
        assert all(again[s] == whole[s] for s in (3, 4)), tag  # the killed run's step 3 and the resumed run's
    assert rollouts(resumed) == lines


def test_a_checkpoint_of_another_staleness_is_refused(prompts, tmp_path, capsys):
    flags = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.last_save_model_only", "false"]
    assert main(grpo_flags(prompts, tmp_path, 1, *flags)) == 0
    assert main(grpo_flags(prompts, tmp_path, 2, *flags, "--rl.max_staleness", "1")) == 2
    err = capsys.readouterr().err
    assert "the checkpoint's rollouts were sampled at rl.max_staleness 0" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.max_staleness", "1", "--rl.num_iterations", "2"], "rl.num_iterations 2 cannot reuse them"),
        (["--rl.max_staleness", "17"], "rl.max_staleness"),
    ],
)
def test_keys_it_cannot_serve_are_one_sentence(prompts, tmp_path, capsys, extra, message):
    assert main(grpo_flags(prompts, tmp_path, 1, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
