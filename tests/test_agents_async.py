"""Agents with asynchronous rollouts (rl.max_staleness K >= 1 with rl.environment): step s trains on episodes sampled by
the weights after step max(0, s - 1 - K), their turns and tool calls run on the engine's thread
(ColocatedEngine.submit_turns) while earlier steps train, the very episodes a synchronous run samples with those
weights; a run killed (-9) with episodes in flight and resumed is
the uninterrupted run, losses and rollouts.jsonl bit for bit. 2 FSDP ranks at K = 1 equal one process in
test_agents_rollout.py's one launch."""

import subprocess
import sys
import time

import pytest
from conftest import ROOT, tensorboard_scalars
from test_agents_rollout import CALCULATOR_RESUMABLE, agent_flags, uncertain  # noqa: F401
from test_grpo import rollouts

from titanlite.train import main

STALE = [*CALCULATOR_RESUMABLE, "--rl.max_staleness", "1", "--rl.importance_sampling", "token_truncate"]


def killed_in_step_3(flags: list[str], log) -> None:
    """The run of `flags` killed (-9) once it logs step 3: its step-2 checkpoint holds step 3's episodes."""
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "titanlite.train", *flags], cwd=ROOT, stdout=out, stderr=out)
        while "step: 3 " not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        process.kill()
        process.wait()


def test_episodes_sampled_ahead_follow_the_schedule_and_a_killed_run_resumes_the_same(uncertain, tmp_path):
    folder, prompts = uncertain
    assert main(agent_flags(folder, prompts, tmp_path / "whole", 4, *STALE)) == 0
    lines = rollouts(tmp_path / "whole")
    assert [line["step"] for line in lines] == [s for s in (1, 2, 3, 4) for _ in range(4)]
    assert all(line["policy_step"] == max(0, line["step"] - 2) for line in lines)
    assert any(line["tool_calls"] for line in lines) and any(0 in line["completion_mask"] for line in lines)
    assert len({line["rewards"]["Calculator"] for line in lines}) > 1  # the groups' rewards differ: the steps train
    synchronous = [flag for flag in STALE if flag not in ("--rl.max_staleness", "1")]
    assert main(agent_flags(folder, prompts, tmp_path / "sync", 1, *synchronous)) == 0
    for ahead, now in zip(lines[:4], rollouts(tmp_path / "sync"), strict=True):  # step 1: the same weights sample it
        assert ahead["logprobs"] == pytest.approx(now["logprobs"], abs=1e-6)
        assert {**ahead, "logprobs": None} == {**now, "logprobs": None}
    low, high = (tensorboard_scalars(tmp_path / "whole" / "tb", f"rl/sampling/ratio_{end}") for end in ("min", "max"))
    assert 1 - 1e-5 <= low[1] <= high[1] <= 1 + 1e-5  # step 1 is on-policy, the later ones one update back
    assert all(high[s] - low[s] > 1e-4 for s in (3, 4))

    resumed = tmp_path / "resumed"
    killed_in_step_3(agent_flags(folder, prompts, resumed, 4, *STALE), tmp_path / "killed.txt")
    assert {line["step"] for line in rollouts(resumed)} >= {1, 2, 3}  # lines the resume must not repeat
    assert main(agent_flags(folder, prompts, resumed, 4, *STALE)) == 0
    for tag in ("loss/train", "optim/grad_norm", "rl/reward", "rl/tool_calls", "rl/sampling/ratio_max"):
        whole, again = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("whole", "resumed"))
        assert all(again[s] == whole[s] for s in (3, 4)), tag
    assert rollouts(resumed) == lines
