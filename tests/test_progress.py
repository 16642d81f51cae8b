"""The progress line every long job prints (titanlite/log.py Progress): due by a monotonic clock, whatever else
the job prints; items done of total, time per item and time left. Training prints it between step lines whatever
metrics.log_freq is, its step line gives the step time and time left (and TensorBoard time/step_seconds), a GRPO
step line says why its steps trained nothing; data preparation reports its documents."""

import json
import re

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU, tensorboard_scalars

from titanlite.config import load_config
from titanlite.data.prepare import prepare
from titanlite.log import Progress, duration
from titanlite.metrics import MetricsLogger
from titanlite.train import main


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_comes_when_the_interval_has_passed_with_time_per_item_and_time_left(caplog):
    clock = Clock()
    progress = Progress(total=10, label="generate", every_seconds=30, unit="prompt", clock=clock)
    clock.now += 12
    assert progress.advance() is None  # 12 s: not due yet
    clock.now += 12
    assert progress.advance() is None
    clock.now += 12
    line = progress.advance()  # 36 s since the start, 3 prompts: 12 s each, 7 left
    assert line == "generate: 3/10 prompts (30%)  12.00 s/prompt  left 1m 24s"
    with caplog.at_level("INFO", logger="titanlite"):
        clock.now += 0.5
        assert progress.advance(4) is None  # the interval restarts at each line
        clock.now += 29.5
        assert progress.advance() == "generate: 8/10 prompts (80%)  8.25 s/prompt  left 16s"
    assert "generate: 8/10 prompts (80%)" in caplog.text


def test_fast_items_read_in_milliseconds_and_done_sums_up(caplog):
    clock = Clock()
    progress = Progress(total=None, label="prepare", every_seconds=5, unit="document", clock=clock)
    for _ in range(400):
        clock.now += 0.025
        progress.advance()
    with caplog.at_level("INFO", logger="titanlite"):
        assert progress.done() == "prepare: 400 documents in 10s (25 ms/document)"
    assert "prepare: 400 documents in 10s" in caplog.text


def test_a_resumed_job_counts_its_earlier_steps_towards_the_total_not_the_time_per_step():
    clock = Clock()
    progress = Progress(total=200, label="train", every_seconds=30, already=100, clock=clock)
    assert progress.status() == "100/200 steps (50%)"  # nothing measured yet: no time per step, no time left
    clock.now += 40
    assert progress.advance(10) == "train: 110/200 steps (55%)  4.00 s/step  left 6m 00s"


def test_another_line_that_reported_the_progress_delays_the_next():
    clock = Clock()
    progress = Progress(total=5, label="train", every_seconds=30, clock=clock)
    clock.now += 29
    progress.reported()  # e.g. the training step line
    clock.now += 29
    assert progress.advance() is None
    clock.now += 1
    assert progress.advance() is not None


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 59, 185, 7620)] == ["0s", "59s", "3m 05s", "2h 07m"]


def test_training_prints_progress_every_30_seconds_between_step_lines_whatever_log_freq(caplog):
    job = load_config(["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "100"])
    metrics = MetricsLogger(job.metrics, 0, torch.device("cpu"), flops_per_token=1.0)
    clock = Clock()
    metrics.start_progress(resumed_step=20, steps=300, clock=clock)
    with caplog.at_level("INFO", logger="titanlite"):
        for step in range(21, 101):  # 10 s a step: a line every third step, none at the logged step 100
            clock.now += 10
            metrics.step_done(step, logged=metrics.should_log(step))
            if step == 100:
                values = metrics.log(step, loss=2.5, grad_norm=1.0, lr=1e-3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: ")]
    assert len(lines) == 26 and lines[0] == "train: 23/300 steps (8%)  10.00 s/step  left 46m 10s"
    step_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step: 100 "))
    assert step_line.endswith("  left: 33m 20s") and "  step_time: " in step_line  # 200 steps at 10 s
    assert values["step_seconds"] > 0  # perf_counter time since the logger was made, over the 100 steps
    clock.now += 29
    assert metrics.progress.advance(0) is None  # the step line restarted the interval


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("equal")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(4)))
    (folder / "rewards.py").write_text("def always_one(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    return folder


def test_a_grpo_step_that_trains_nothing_says_why(prompts, tmp_path, capsys):
    """Every completion scores 1: every group's rewards are equal, every advantage 0, loss and gradients 0."""
    assert (
        main(
            [
                *ON_CPU,
                "--job.config_file",
                DEBUG_CONFIG,
                "--job.dump_folder",
                str(tmp_path),
                "--training.dataset_format",
                "prompts",
                "--training.dataset_path",
                str(prompts / "prompts.jsonl"),
                "--training.seq_len",
                "32",
                "--training.steps",
                "2",
                "--training.local_batch_size",
                "4",
                "--training.global_batch_size",
                "4",
                "--rl.num_generations",
                "2",
                "--rl.max_new_tokens",
                "6",
                "--rl.reward_functions",
                f"{prompts / 'rewards.py'}:always_one",
                "--metrics.log_freq",
                "1",
                "--lr_scheduler.warmup_steps",
                "0",
                "--metrics.enable_tensorboard",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    lines = re.findall(r"step: 2 .*", err)
    assert len(lines) == 1 and "loss: 0.0000  grad_norm: 0.0000" in lines[0], err
    assert re.search(
        r"  step_time: [\d.]+s  left: 0s  .*reward: 1.0000  equal_reward_groups: 100%  "
        r"completion_tokens: [\d.]+  clipped: 0.0%$",
        lines[0],
    ), lines[0]
    assert (
        "in this step every group's completions had equal rewards (mean 1.0000), so every advantage is 0 and this "
        "step trained nothing (loss and gradients 0)"
    ) in err
    step_seconds = tensorboard_scalars(tmp_path / "tb", "time/step_seconds")
    assert sorted(step_seconds) == [1, 2] and all(seconds > 0 for seconds in step_seconds.values())
    lengths = tensorboard_scalars(tmp_path / "tb", "rl/completion_length")
    assert f"completion_tokens: {lengths[2]:.1f}" in lines[0]


def test_data_preparation_reports_its_documents(tmp_path, caplog):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(10)))
    with caplog.at_level("INFO", logger="titanlite"):
        prepare(str(texts), str(tmp_path / "store"), documents_per_shard=4, progress_seconds=0)
    said = [r.getMessage() for r in caplog.records]
    assert [line.split("  ")[0] for line in said[:3]] == [
        f"tokenizing {texts}: {n}/10 documents ({10 * n}%)" for n in (4, 8, 10)
    ]
    assert re.fullmatch(rf"tokenizing {texts}: 10 documents in \d+s \(\d+ ms/document\)", said[3])
    caplog.clear()
    (tmp_path / "store" / "manifest.json").unlink()  # as if stopped before the manifest: the shards are kept
    with caplog.at_level("INFO", logger="titanlite"):
        prepare(str(texts), str(tmp_path / "store"), documents_per_shard=4, progress_seconds=0)
    assert [r.getMessage() for r in caplog.records] == [f"tokenizing {texts}: 10 documents in 0s"]
