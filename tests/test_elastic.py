"""Elastic restarts: torchrun --max-restarts brings the worker group back after one worker dies,
and the trainer resumes from the newest checkpoint. The test kills a real worker with SIGKILL."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, ROOT

from titanlite.errors import UserError
from titanlite.parallel.dist import check_restartable

STEPS = 8


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the workers torchrun (pid `launcher`) has started, read from /proc."""
    children = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        children += (task / "children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((int(entry[5:]) for entry in environ if entry.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = pid
    return ranks


def test_a_killed_worker_restarts_the_group_from_the_last_checkpoint(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "titanlite.train",
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(STEPS),
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launcher = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    # Whatever happens, nothing this test started outlives it (torchrun and its workers share the session).
    watchdog = threading.Timer(240, os.killpg, (launcher.pid, signal.SIGKILL))
    watchdog.start()
    lines, killed = [], None
    try:
        for line in launcher.stdout:
            lines.append(line)
            if killed is None and "checkpoint step-2 saved" in line:
                killed = worker_pids(launcher.pid)[1]  # rank 0 is the one that logs; kill the other
                os.kill(killed, signal.SIGKILL)
        returncode = launcher.wait()
    finally:
        watchdog.cancel()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    output = "".join(lines)

    assert killed is not None, output
    assert returncode == 0, output
    assert re.search(rf"failed \(exitcode: -9\) local_rank: 1 \(pid: {killed}\)", output), output
    (resumed,) = re.findall(r"resumed from \S+/step-(\d+) at step (\d+)", output)
    assert resumed[0] == resumed[1] and int(resumed[0]) >= 2, resumed
    start = int(resumed[0])
    after_resume = output[output.index("resumed from") :]
    steps = [int(s) for s in re.findall(r"(?<!validate )step: (\d+)  loss", after_resume)]
    assert steps == list(range(start + 1, STEPS + 1)), output
    assert f"training finished after {STEPS} steps" in output
    assert (tmp_path / "checkpoint" / f"step-{STEPS}").is_dir()


def test_restarts_on_the_shared_rendezvous_store_are_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(UserError, match="torchrun --max-restarts 3 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives
    check_restartable()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    check_restartable()
