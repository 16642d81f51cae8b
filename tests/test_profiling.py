"""Profiler traces per rank and step, the CPU refusal of memory snapshots, the run summary."""

import json
import re

import pytest
import torch
from conftest import run_titanlite

from titanlite.config_sections import Profiling
from titanlite.errors import UserError
from titanlite.metrics.profiling import RunSummary, StepProfiler

SUMMARY = re.compile(r"run summary: 2 steps after 2 warm-up  tps: [\d,]+  step: [\d.]+s  .*state_per_rank: params ")


def test_traces_every_profile_freq_steps_and_the_summary_line(tmp_path, tiny_run):
    out = run_titanlite(
        tiny_run
        + ["--profiling.enable_profiling", "--profiling.profile_freq", "2", "--metrics.summary_warmup_steps", "2"]
    )
    assert out.returncode == 0, out.stderr
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    trace = json.loads((traces / "iteration_4" / "rank0_trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names  # the step's ops are in it
    assert SUMMARY.search(out.stderr), out.stderr


def test_memory_snapshot_needs_cuda(tmp_path):
    with pytest.raises(UserError, match="enable_memory_snapshot records the CUDA allocator's history and needs a GPU"):
        StepProfiler(Profiling(enable_memory_snapshot=True), str(tmp_path), 0, torch.device("cpu"))


def test_summary_counts_only_the_steps_after_warmup():
    class Metrics:
        data_seconds = 0.0
        tokens = 0

    metrics = Metrics()
    summary = RunSummary(warmup=2, steps_to_run=5, device=torch.device("cpu"))
    for step in range(5):
        summary.step_began(metrics)
        metrics.data_seconds += 1.0
        metrics.tokens += 64 * (step + 1)  # as next_batch counts them: DPO's widths vary from step to step
        summary.step_ended(metrics)
    assert summary.steps == 3 and summary.data_seconds == 3.0 and summary.tokens == 64 * (3 + 4 + 5)
    assert summary.started is not None and summary.ended >= summary.started
    assert RunSummary(warmup=10, steps_to_run=4, device=torch.device("cpu")).warmup == 3  # at least one step counts


def test_memory_snapshots_every_profile_freq_and_on_oom(tmp_path, monkeypatch):
    """The CUDA path, with the allocator's history functions faked (no GPU here)."""
    history = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: history.append((a, kw)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": []})
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=2)
    profiler = StepProfiler(cfg, str(tmp_path), 3, torch.device("cuda"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with profiler:
            for step in (1, 2, 3):
                profiler.step(step)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (pretend)")
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.pickle")) == [
        "iteration_2/rank3_memory_snapshot.pickle",
        "oom/rank3_memory_snapshot.pickle",
    ]
    assert history[0][1] == {"max_entries": 100_000} and history[-1][1] == {"enabled": None}  # started, then stopped
