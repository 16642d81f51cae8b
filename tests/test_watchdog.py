"""job.hang_timeout_seconds: a rank that blocks is named, every rank dumps its stacks, the job exits with
code 3, and the next run resumes from the last checkpoint as if nothing had happened. A rank that alone
meets a user error says so before torchrun stops the others."""

import os
import re
import signal
import subprocess
import sys

from conftest import DEBUG_CONFIG, ON_CPU, ROOT, logged_losses, run_titanlite


def flags(dump) -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "false",
    ]


def run_with_fault(fault: str, args: list[str]) -> subprocess.CompletedProcess:
    """Two ranks under torchrun; rank 1 meets `fault` in its third step (tests/fault_run.py)."""
    env = {**os.environ, "FAULT": fault, "FAULT_RANK": "1", "FAULT_AT_STEP": "3"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "tests/fault_run.py",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_blocked_rank_is_named_the_job_exits_3_and_resumes_from_the_last_checkpoint(tmp_path):
    hung = run_with_fault("hang", [*flags(tmp_path / "run"), "--job.hang_timeout_seconds", "8"])
    assert hung.returncode != 0
    err = hung.stderr
    # Rank 1 blocks in step 3; rank 0 waits for it in step 3's first collective.
    (sentence,) = re.findall(r"ERROR (hang: .*)", err)
    assert sentence.startswith("hang: ranks 0, 1 did not finish step 3; rank 0 finished step 2, now in step 3: "), (
        sentence
    )
    assert re.search(
        r"rank 1 finished step 2, now in step 3: train_step_with_a_fault \(.*fault_run.py:\d+\), called from "
        r"one_step \(.*titanlite/train.py:\d+\)",
        sentence,
    ), sentence
    assert "exiting with code 3" in sentence
    assert "exitcode  : 3" in err  # torchrun's report: the workers' own exit code
    for rank in (0, 1):
        stacks = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert "hang watchdog: step" in stacks and "Thread 0x" in stacks  # faulthandler's dump of every thread

    resumed = run_titanlite(flags(tmp_path / "run"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    clean = run_titanlite(flags(tmp_path / "clean"), nproc=2)
    assert logged_losses(resumed.stderr) == {s: v for s, v in logged_losses(clean.stderr).items() if s > 2}


def test_a_user_error_on_one_rank_is_said_once_before_torchrun_stops_the_others(tmp_path):
    """Rank 1 alone fails while rank 0 waits for it in a collective: when rank 1 exits, torchrun kills rank 0,
    so the sentence must come from the rank that failed (rank 0 speaking for all would say nothing)."""
    failed = run_with_fault("user_error", flags(tmp_path))
    assert failed.returncode != 0
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 alone cannot go on"], failed.stderr[-3000:]


def test_a_rank_killed_by_an_abort_prints_where_it_was(tmp_path):
    """An abort in a collective library or a segfault kills a rank without a Python traceback; faulthandler
    prints every thread's stack first, so the log says where the rank was, not only "Signal 6"."""
    args = [*flags(tmp_path), "--training.steps", "100000", "--checkpoint.enable", "false"]
    run = subprocess.Popen(
        [sys.executable, "-m", "titanlite.train", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    for line in run.stderr:  # training has begun
        if "step:" in line:
            break
    os.kill(run.pid, signal.SIGABRT)
    rest = run.stderr.read()
    assert run.wait(timeout=60) == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in rest and "Thread 0x" in rest
    assert re.search(r'File ".*titanlite/(train|step)\.py", line \d+ in \w+', rest), rest[-3000:]
