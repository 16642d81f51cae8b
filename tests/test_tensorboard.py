"""TensorBoard as a user sees it (the real server over HTTP), one line per job across kill -9,
resume and rewind, and the training time a checkpoint save really cost."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import DEBUG_CONFIG, ROOT, checkpointed_run, checkpointed_training, logged_losses, run_titanlite
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.checkpoint.cost import SaveCost
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.config_sections import Checkpoint
from titanlite.log import init_logger

TENSORBOARD = Path(sys.executable).parent / "tensorboard"
SAVE_LINE = re.compile(r"checkpoint step-(\d+): training lost (-?[\d.]+)s \(.*; blocked ([\d.]+)s\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def tensorboard_server(logdir: Path):
    """The real `tensorboard` on 127.0.0.1; yields get(path, body=None) -> parsed JSON."""
    port = free_port()
    server = subprocess.Popen(
        [str(TENSORBOARD), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def get(path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    try:
        for _ in range(120):  # it loads the event files in the background after it starts serving
            try:
                if get("/data/plugin/scalars/tags"):
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read()
            time.sleep(0.5)
        yield get
    finally:
        server.terminate()
        server.wait(timeout=30)


def scalars(run: Path, tag: str) -> list:
    """The events of `tag` in one run folder, as TensorBoard keeps them (purged past a restart)."""
    events = EventAccumulator(str(run))
    events.Reload()
    return events.Scalars(tag)


def config_steps(run: Path) -> list[int]:
    events = EventAccumulator(str(run))
    events.Reload()
    return [e.step for e in events.Tensors("config/text_summary")]


@pytest.mark.extended
def test_two_rank_dashboard_read_over_http(tmp_path):
    out = run_titanlite(
        [
            "--job.config_file",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(tmp_path),
            "--job.description",
            "dash test",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "13",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "--metrics.save_for_all_ranks",
            "--metrics.summary_warmup_steps",
            "1",
            "--validation.enable",
            "--validation.freq",
            "4",
            "--validation.steps",
            "2",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "4",
            "--checkpoint.async_mode",
            "async",
        ],
        nproc=2,
    )
    assert out.returncode == 0, out.stderr
    (job,) = (tmp_path / "tb").iterdir()
    assert re.fullmatch(r"dash_test-\d{8}-\d{6}", job.name)
    runs = {f"{job.name}/rank0", f"{job.name}/rank1"}
    with tensorboard_server(tmp_path / "tb") as get:
        tags = get("/data/plugin/scalars/tags")
        assert set(tags) == runs
        expected = {
            "loss/train",
            "loss/validation",
            "perplexity/validation",
            "throughput/tps",
            "throughput/tflops",
            "memory/reserved_gib",
            "memory/share",
            "memory/capacity_gib",
            "optim/lr",
            "optim/grad_norm",
            "data/wait_share",
            "data/trained_tokens",
            "checkpoint/save_seconds",
            "checkpoint/blocked_seconds",
            "checkpoint/training_lost_seconds",
            "time/step_seconds",
        }  # no throughput/mfu: a CPU has no known peak
        assert set(tags[f"{job.name}/rank0"]) == expected
        assert set(tags[f"{job.name}/rank1"]) == expected  # every rank measures its own tps and memory

        layout = get("/data/plugin/custom_scalars/layout")
        charts = {c["title"]: c["multiline"]["tag"] for cat in layout["category"] for c in cat["chart"]}
        assert charts["loss: train and validation"] == [r"^loss/(train|validation)$"]
        assert {
            "tokens per second per device",
            "memory against the device's capacity (GiB)",
            "learning rate",
            "grad_norm (before clipping)",
        } <= set(charts)
        assert charts[
            "no MFU: cpu has no known peak FLOP/s (set metrics.peak_tflops); achieved TFLOP/s per device"
        ] == [r"^throughput/tflops$"]

        (text,) = get(f"/data/plugin/text/text?run={job.name}/rank0&tag=config/text_summary")
        assert "seq_len = 64" in text["text"] and 'description = "dash test"' in text["text"]

        experiment = get("/data/plugin/hparams/experiment", {"experimentName": ""})
        assert {h["name"] for h in experiment["hparamInfos"]} == {
            "family",
            "flavor",
            "world_size",
            "mesh",
            "AC",
            "compile",
            "float8",
            "loss chunks",
            "batch",
            "seq_len",
            "lr",
            "dataset",
        }
        assert [m["name"]["tag"] for m in experiment["metricInfos"]] == [
            "loss/train",
            "throughput/tps",
            "throughput/mfu",
        ]
        groups = get(
            "/data/plugin/hparams/session_groups",
            {
                "experimentName": "",
                "startIndex": 0,
                "sliceSize": 10,
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
            },
        )
        (group,) = groups["sessionGroups"]  # rank 0 describes the run
        assert group["hparams"] | {"lr": 0} == {
            "family": "llama3",
            "flavor": "debugmodel",
            "world_size": 2.0,
            "mesh": "dp_replicate 1 x dp_shard 2 x tp 1, pp 1",
            "AC": "none",
            "compile": "off",
            "float8": "off",
            "loss chunks": "off",
            "batch": 4.0,
            "seq_len": 64.0,
            "lr": 0,
            "dataset": "sample",
        }
        final = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert final["loss/train"] == pytest.approx(logged_losses(out.stderr)[13], abs=1e-4)

    # The save figure: every save reports what it cost the steps it touched, never less than the time it
    # blocked the loop (those steps contain that wait; less would be the steady time's noise).
    saves = {int(s): (float(b), float(lost)) for s, lost, b in SAVE_LINE.findall(out.stderr)}
    assert sorted(saves) == [4, 8, 12, 13]
    assert all(lost >= blocked for blocked, lost in saves.values()), out.stderr
    written = {e.step: e.value for e in scalars(job / "rank0", "checkpoint/training_lost_seconds")}
    assert written == pytest.approx({s: lost for s, (_, lost) in saves.items()}, abs=1e-3)
    summary_lost = float(re.search(r"checkpoints: 4 saves, training lost (-?[\d.]+)s", out.stderr).group(1))
    assert summary_lost == pytest.approx(sum(lost for _, lost in saves.values()), abs=2e-3)


def resume_flags(folder: Path, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(folder),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.async_mode",
        "async",
        *extra,
    ]


@pytest.mark.extended
def test_kill_resume_and_rewind_draw_one_line(tmp_path):
    killed = subprocess.Popen(resume_flags(tmp_path), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = ""
    for line in killed.stderr:
        log += line
        if re.search(r"(?<!validate )step: 6 ", line):
            killed.send_signal(signal.SIGKILL)
            break
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL, log
    (job,) = (tmp_path / "tb").iterdir()
    drawn = sorted(e.step for e in scalars(job, "loss/train"))
    assert drawn[:5] == list(range(1, 6))  # flushed at each log step (step 6's line comes before its events)

    resumed = subprocess.run(resume_flags(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [job.name]  # the job's run, continued
    steps = [e.step for e in scalars(job, "loss/train")]
    assert steps == list(range(1, 9))  # strictly increasing, no gap, no duplicate of the killed tail
    resumed_at = int(re.search(r"resumed from .* at step (\d+)", resumed.stderr).group(1))
    assert config_steps(job) == [0, resumed_at]  # each start's config, at the step it started from

    rewind_started = time.time()
    rewound = subprocess.run(
        resume_flags(tmp_path, "--checkpoint.load_step", "3"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert rewound.returncode == 0, rewound.stderr
    events = scalars(job, "loss/train")
    assert [e.step for e in events] == list(range(1, 9))
    assert all((e.wall_time > rewind_started) == (e.step > 3) for e in events)  # the tail is the rewound run's
    assert {e.step: round(e.value, 4) for e in events if e.step > 3} == logged_losses(rewound.stderr)
    with tensorboard_server(tmp_path / "tb") as get:  # as a user sees it: the abandoned tail's config went too
        assert [e[1] for e in get(f"/data/plugin/scalars/scalars?run={job.name}&tag=loss/train")] == list(range(1, 9))
        configs = get(f"/data/plugin/text/text?run={job.name}&tag=config/text_summary")
        assert [e["step"] for e in configs] == sorted({0, 3} | ({resumed_at} if resumed_at < 3 else set()))


def written_layout(folder: Path) -> dict[str, dict[str, list[str]]]:
    """The CUSTOM SCALARS layout TensorBoard draws from a run's event file (the last one written):
    {category: {chart title: its tag patterns}}."""
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder))
    events.Reload()
    last = events.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1]
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(last.tensor_proto).item())
    return {
        category.title: {chart.title: list(chart.multiline.tag) for chart in category.chart}
        for category in layout.category
    }


@pytest.mark.parametrize("peak", [0.0, 989.0])
def test_the_dashboard_has_a_chart_for_every_group_a_run_writes(tmp_path, peak):
    """The lr alone on its chart; an RL, DPO and eval section with a chart per tag (each quantity on its own axis)
    joins the layout when its first tag is written, as the real TensorBoard serves it; without a known peak the MFU
    chart says why and draws the achieved TFLOP/s instead."""
    from titanlite.config import load_config
    from titanlite.metrics import MetricsLogger

    job = load_config(["--job.config_file", DEBUG_CONFIG, "--metrics.peak_tflops", str(peak)])
    metrics = MetricsLogger(job.metrics, 0, torch.device("cpu"), flops_per_token=1.0)
    metrics.start_tensorboard(tmp_path, job, 0, {"lr": job.optimizer.lr})
    metrics.write_scalars(1, {"loss/train": 8.0, "optim/lr": 8e-4, "optim/grad_norm": 1.0}, flush=True)
    (charts,) = written_layout(tmp_path).values()
    assert charts["learning rate"] == [r"^optim/lr$"] and charts["grad_norm (before clipping)"] == [
        r"^optim/grad_norm$"
    ]
    assert charts["step time (s)"] == [r"^time/step_seconds$"]
    mfu = {title: tags for title, tags in charts.items() if "MFU" in title}
    assert list(charts)[2] in mfu  # beside tps, where it is either way
    assert mfu == (
        {"MFU (%)": [r"^throughput/mfu$"]}
        if peak > 0
        else {
            "no MFU: cpu has no known peak FLOP/s (set metrics.peak_tflops); achieved TFLOP/s per device": [
                r"^throughput/tflops$"
            ]
        }
    )
    assert set(written_layout(tmp_path)) == {"titanlite"}  # no empty charts for groups the run has not written

    metrics.write_scalars(
        2,
        {
            "dpo/reward_accuracy": 0.5,
            "dpo/margin": 0.1,
            "eval/arc_easy/acc": 0.3,
            "eval/arc_easy/acc_norm": 0.3,
            "eval/mmlu_anatomy/acc": 0.2,
            "rl/completion_length": 12.0,
            "rl/reward/letter_share": 0.2,
            "rl/reward": 1.0,
        },
        flush=True,
    )
    metrics.write_scalars(3, {"eval/arc_easy/acc": 0.4, "dpo/margin": 0.2}, flush=True)  # nothing new: no new layout
    layout = written_layout(tmp_path)
    assert layout["titanlite"] == charts
    assert layout["DPO"] == {
        "dpo/reward_accuracy: share of pairs whose chosen reward beats the rejected": [r"^dpo/reward_accuracy$"],
        "dpo/margin: mean chosen minus rejected reward": [r"^dpo/margin$"],
    }
    assert layout["eval"] == {
        "eval/arc_easy/acc": [r"^eval/arc_easy/acc$"],
        "eval/arc_easy/acc_norm": [r"^eval/arc_easy/acc_norm$"],
        "eval/mmlu_anatomy/acc": [r"^eval/mmlu_anatomy/acc$"],
    }
    assert list(layout["RL"].items()) == [  # the reward first, whatever order the tags came in
        ("rl/reward: mean reward (the weighted sum of the reward functions)", [r"^rl/reward$"]),
        ("rl/reward/letter_share: mean reward of the function letter_share", [r"^rl/reward/letter_share$"]),
        ("rl/completion_length: mean completion length (tokens)", [r"^rl/completion_length$"]),
    ]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert len(events.Tensors("custom_scalars__config__")) == 2  # the start's layout, then once with the new groups
    metrics.close()
    with tensorboard_server(tmp_path) as get:  # as the browser receives it: each pattern matches its one tag
        served = get("/data/plugin/custom_scalars/layout")
        tags = set(get("/data/plugin/scalars/tags")["."])
    assert {c["title"]: list(c["multiline"]["tag"]) for c in served["category"][1]["chart"]} == layout[
        served["category"][1]["title"]
    ]
    for category in served["category"][1:]:
        for chart in category["chart"]:
            (pattern,) = chart["multiline"]["tag"]
            assert len([tag for tag in tags if re.search(pattern, tag)]) == 1, (pattern, tags)


def test_save_cost_is_the_extra_time_of_the_steps_it_touched():
    reported = {}
    cost = SaveCost(lambda step, values: reported.update({step: values}), warmup_steps=1)
    clock = 0.0
    # Step i takes durations[i]; a save starts at 3.05 and finishes writing at 3.65.
    durations = [2.0, 0.5, 0.5, 0.5, 0.9, 0.7, 0.5, 0.5, 0.5, 0.5]
    for i, seconds in enumerate(durations):
        if i == 6:
            cost.save_finished(4, started=3.05, done_at=3.65, blocked=0.01)
        cost.step_done(clock, clock + seconds)
        clock += seconds
    # Step 3 runs 3.0-3.5 and step 4 3.5-4.4: the save touched those two; the steady step is 0.5 s.
    assert reported[4]["checkpoint/training_lost_seconds"] == pytest.approx((0.5 - 0.5) + (0.9 - 0.5))
    assert reported[4]["checkpoint/blocked_seconds"] == pytest.approx(0.01)
    assert reported[4]["checkpoint/save_seconds"] == pytest.approx(0.6)
    assert cost.saves == 1 and cost.lost_seconds == pytest.approx(0.4)


def test_a_save_that_waits_for_the_previous_write_says_so_once(tmp_path, world_of_one, capsys):
    init_logger(0)  # onto the stderr capsys captures
    model = torch.nn.Linear(512, 512)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(
        checkpointed_run(model, Checkpoint(enable=True, interval=1, async_mode="async"), tmp_path),
        checkpointed_training(
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            StatefulDataLoader(list(range(4))),
        ),
    )
    for step in (1, 2, 3):  # no training between the saves: each one starts while the previous one writes
        manager.maybe_save(step)
    manager.close()
    err = capsys.readouterr().err
    (warning,) = re.findall(r"WARNING (checkpoint step-2 waited .*)", err)
    write = float(re.search(r"step-1's save, which took ([\d.]+)s to write", warning).group(1))
    assert write > 0 and "with checkpoint.interval 1 every save blocks training" in warning
    assert int(re.search(r"set checkpoint.interval to (\d+) or more", warning).group(1)) > 1
    assert sorted(int(s) for s in re.findall(r"checkpoint step-(\d) saved in", err)) == [1, 2, 3]


def test_a_step_two_saves_touched_is_shared_by_their_overlaps():
    reported = {}
    cost = SaveCost(lambda step, values: reported.update({step: values["checkpoint/training_lost_seconds"]}))
    # Steps of 1 s, but step 4 (4.0-5.5) took 1.5 s; save 10 writes 3.5-4.75, save 11 waits for it and writes 4.75-5.5.
    bounds = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5.5), (5.5, 6.5), (6.5, 7.5), (7.5, 8.5), (8.5, 9.5)]
    for i, (began, ended) in enumerate(bounds):
        if i == 5:
            cost.save_finished(10, started=3.5, done_at=4.75, blocked=0.0)
            cost.save_finished(11, started=4.75, done_at=5.5, blocked=0.0)
        cost.step_done(began, ended)
    # Step 4's extra 0.5 s: each save overlapped 0.75 s of it; step 3 (save 10's) was steady.
    assert reported == pytest.approx({10: 0.25, 11: 0.25})
