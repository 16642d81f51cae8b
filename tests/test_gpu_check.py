"""scripts/gpu_check.py, on the CPU: every run it would start on a lent GPU is a valid job, and its
report reads the run summary lines the trainer prints."""

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

from titanlite.config import load_config  # noqa: E402


@pytest.mark.parametrize("name", list(gpu_check.RUNS))
def test_every_run_is_a_valid_job(name, tmp_path):
    """A typo in a flag would cost GPU minutes: each run's arguments load as they would there."""
    cfg = load_config(gpu_check.job_arguments(name, tmp_path, "H100 SXM"))
    assert (cfg.model.flavor, cfg.training.seq_len) == ("8B" if name.startswith("8b") else "1B", 8192)
    assert cfg.model.attention_mask == ("block_causal" if name.startswith("sample_block_causal") else "causal")
    assert cfg.activation_checkpoint.offload_activations == ("offload" in name)
    assert cfg.float8.enable == (name.startswith(("float8", "best")) or name == "8b_layers_float8")
    assert cfg.training.loss_chunk_tokens == (4096 if "loss_chunks" in name else 0)


def test_report_reads_the_run_summary_lines(tmp_path):
    """A run's figures from its log; a run without a log is left out."""
    (tmp_path / "compile.log").write_text(
        "run summary: 30 steps after 10 warm-up  tps: 12,345  step: 1.3271s  tflops: 400.1  mfu: 40.45%  "
        "peak_memory: 60.125GiB  data: 0.10%  state_per_rank: params 1.000MiB  checkpoints: 2 saves, training lost "
        "0.420s"
        "  activation_offload: peak 7.500GiB held in host memory (not held on the device)\n"
        "run summary: predicted vs measured: peak_memory 58.000GiB vs 60.125GiB  tps 13,000 vs 12,345\n"
    )
    table = gpu_check.write_report(tmp_path)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results == {
        "compile": {
            "tps": 12345.0,
            "mfu_pct": 40.45,
            "peak_memory_gib": 60.125,
            "predicted_peak_gib": 58.0,
            "predicted_tps": 13000.0,
            "checkpoint_lost_s": 0.42,
            "offload_held_gib": 7.5,
        }
    }
    assert "| compile | 12,345.00 | 40.45 | 60.12 | 58.00 | 13,000.00 | 0.42 | 7.50 |" in table
    assert (tmp_path / "gpu_check.md").read_text() == table


def test_unknown_group_is_refused_and_list_names_every_run(capsys):
    assert gpu_check.main(["out", "tabel"]) == 2
    assert "groups: tests cuda table offload shapes attention saves; or run names" in capsys.readouterr().err
    assert gpu_check.main(["out", "compile", "cuda"]) == 1  # a run name and a test group: valid, but no GPU here
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert gpu_check.main(["--list"]) == 0
    listed = [line.split("\t")[1] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(gpu_check.RUNS)


def test_a_run_past_its_time_is_killed_with_its_worker(tmp_path, monkeypatch, capsys):
    """A hung run must not take its group's GPU command with it: torchrun and its worker both go."""
    import subprocess

    monkeypatch.setattr(gpu_check, "RUN_TIMEOUT_S", 3)  # the 1B model on a CPU is far from done by then
    gpu_check.train("compile", tmp_path, "H100 SXM")
    assert f"compile: FAILED (timed out after 3 s), see {tmp_path}/compile.log" in capsys.readouterr().out
    assert (tmp_path / "compile.log").read_text().startswith(f"{sys.executable} -m torch.distributed.run")
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1  # nothing left
