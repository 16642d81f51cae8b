"""The benchmark scripts in their short modes: every kind of row runs and the comparisons are printed."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.extended
def test_short_benchmark_prints_the_table_and_comparisons(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--short", "--work-dir", str(tmp_path)],
        # Its CPU rows: no GPU visible to the benchmark or the runs it starts.
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "device: " in text and "(CPU)" in text
    for row in ("bare", "titanlite", "fsdp2", "ckpt_sync", "ckpt_async"):
        assert f"| {row} |" in text, text
    assert "overhead: titanlite runs at " in text
    assert "FSDP memory: params + grads + optimizer state per rank" in text and "(within the 1.05/N" in text
    assert "checkpoint: a synchronous save blocks training" in text


@pytest.mark.extended
def test_fault_tolerance_benchmark_prints_its_rows():
    """scripts/ft_benchmark.py, short: plain HSDP, the baseline without torchft (per tensor and flat), per-step torchft
    and DiLoCo each print a step time."""
    out = subprocess.run(
        [sys.executable, "scripts/ft_benchmark.py", "--steps", "10", "--sync_steps", "5", "--seq_len", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for row in (
        "plain HSDP (torchrun, dp_replicate 2, FSDP2):",
        "no torchft, one gloo all-reduce per tensor:",
        "no torchft, one flat all-reduce (torch.cat):",
        "torchft, quorum + average + commit per step:",
        "torchft DiLoCo, sync every 5 steps:",
    ):
        assert re.search(re.escape(row) + r"\s+[\d.]+ s/step", out.stdout), out.stdout


@pytest.mark.extended
def test_packing_benchmark_prints_both_sides_and_the_ratio(tmp_path):
    """scripts/benchmark_packing.py, short: a packed and an unpacked run of the debug Qwen3 on ChatML conversations of
    50-150 tokens, each side's trained tokens per second, and packed windows fuller than unpacked ones."""
    out = subprocess.run(
        [
            sys.executable,
            "scripts/benchmark_packing.py",
            "--conversations",
            "60",
            "--seq_len",
            "256",
            "--batch",
            "2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--pairs",
            "1",
            "--work-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"data: 60 ChatML conversations of (\d+)-(\d+) tokens", out.stdout), out.stdout
    pair = re.search(
        r"pair 1: packed ([\d,]+) trained tok/s .* windows (\d+)% full\);  unpacked ([\d,]+) trained tok/s "
        r".* windows (\d+)% full\): ([\d.]+)x",
        out.stdout,
    )
    assert pair and int(pair.group(2)) > 2 * int(pair.group(4)), out.stdout
    assert "packed / unpacked trained tokens per second: median" in out.stdout
