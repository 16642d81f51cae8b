"""A finished run exits 0: its process leaves without the interpreter's teardown, in which a gloo worker thread
still freeing a collective's tensor aborted both ranks of finished runs ("terminate called without an active
exception", SIGABRT, torchrun reporting failure); and leaving that way loses neither a log line nor the last
asynchronous checkpoint."""

import subprocess
import sys

from conftest import DEBUG_CONFIG, ON_CPU, ROOT


def test_a_finished_ep2_run_exits_0_though_a_gloo_worker_waits_for_the_gil_at_exit(tmp_path):
    # tests/exit_run.py puts rank 0's worker where a starved one was: waiting for the GIL as the interpreter
    # would begin its teardown. Before exit_process, every such run aborted.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "tests/exit_run.py",
            *ON_CPU,
            "--job.config_file",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(tmp_path),
            "--model.name",
            "qwen3_moe",
            "--training.seq_len",
            "64",
            "--training.steps",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--job.log_rank_files",
            "--checkpoint.enable",
            "--checkpoint.async_mode",
            "async",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr
    for rank in (0, 1):
        assert "training finished after 2 steps" in (tmp_path / "logs" / f"rank{rank}.log").read_text()
    assert (tmp_path / "checkpoint" / "step-2" / ".metadata").is_file()
