"""SIGTERM during a GRPO rollout (a real process): the decode stops at its next token, the last finished step is
saved and the process exits within seconds, not after the rollout and its step; the prompts of the stopped rollout
are the resumed run's next ones."""

import json
import signal
import subprocess
import sys
import time

from conftest import DEBUG_CONFIG, ROOT

from titanlite.train import main

FLAGS = [
    "--job.device",
    "cpu",
    "--job.config_file",
    DEBUG_CONFIG,
    "--training.dataset_format",
    "prompts",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "8",
    "--training.global_batch_size",
    "16",
    "--rl.num_generations",
    "8",
    "--rl.max_new_tokens",
    "200",
    "--rl.reward_functions",
    "tests/grpo_rewards.py:letter_share",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "100",
    "--checkpoint.last_save_model_only",
    "false",
    "--rl.log_rollouts",
]


def test_sigterm_during_a_rollout_saves_the_last_step_within_seconds(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: say eeee"}) + "\n" for i in range(12)))
    flags = [*FLAGS, "--training.dataset_path", str(prompts), "--job.dump_folder", str(tmp_path / "run")]
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "titanlite.train", *flags, "--training.steps", "3"], cwd=ROOT, stderr=out, stdout=out
        )
        while "step: 1 " not in log.read_text():  # step 2's rollout begins
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    took = time.perf_counter() - signalled
    text = log.read_text()
    assert "stopped at step 1 on SIGTERM; exiting" in text and "step: 2 " not in text
    assert took < 8, f"{took:.1f} s from SIGTERM to exit"
    print(f"{took:.1f} s from SIGTERM to exit")
    assert (tmp_path / "run" / "checkpoint" / "step-1").is_dir()
    first = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {line["step"] for line in first} == {1}

    fresh = [*flags[:-2], "--job.dump_folder", str(tmp_path / "fresh"), "--rl.max_new_tokens", "1"]
    assert main([*fresh, "--training.steps", "2"]) == 0
    expected = [
        json.loads(line)["prompt_ids"] for line in (tmp_path / "fresh" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert main([*flags, "--training.steps", "2", "--rl.max_new_tokens", "1"]) == 0
    resumed = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in resumed] == [1] * 16 + [2] * 16
    assert [line["prompt_ids"] for line in resumed] == expected  # step 2's prompts are the stopped rollout's
