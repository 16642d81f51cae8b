"""One run per dump folder: two runs started into one `job.dump_folder` would overwrite each other's
checkpoints. Rank 0 holds `<dump_folder>/.titanlite.lock`, a JSON record of its host, pid, start time and
job (Slurm's or torchrun's id), and touches it every HEARTBEAT seconds while it runs; it removes it at exit.

A second run finding the lock stops in one sentence, unless the lock is stale: its process is gone (same
host, pid not alive), it was not touched for STALE seconds (a run killed on another host), or it belongs
to the same job (an elastic restart or a requeue of it, whose old rank 0 is gone). A stale lock is taken
over with a log line.
"""

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from titanlite.errors import UserError
from titanlite.log import logger

LOCK = ".titanlite.lock"
HEARTBEAT = 30.0
STALE = 120.0
PID_MAX = 1 << 22  # Linux's largest pid_max: a pid outside 1..PID_MAX is a damaged record, not a process to look for


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def stale_reason(holder: dict, age: float) -> str | None:
    """Why the run that took the lock cannot be running any more; None where it may be."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and type(pid) is int and 0 < pid <= PID_MAX and not process_alive(pid):
        return f"its process {holder.get('pid')} on this host is gone"
    if age > STALE:
        return f"it was last touched {age:.0f} s ago"
    if job_id() and holder.get("job") == job_id() and holder.get("pid") != os.getpid():
        return f"it belongs to this job ({job_id()}), restarted"
    return None


def read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (ValueError, UnicodeDecodeError, OSError):
        return {}  # a half-written or damaged lock says nothing of a live run: it ages into staleness


def take_lock(folder: Path) -> Path:
    path = folder / LOCK
    if path.exists():
        holder, age = read_holder(path), time.time() - path.stat().st_mtime
        reason = stale_reason(holder, age)
        if reason is None:
            raise UserError(
                f"job.dump_folder {folder} is in use by another run (host {holder.get('host', '?')}, pid "
                f"{holder.get('pid', '?')}, started {holder.get('started', '?')}): two runs in one folder would overwrite "
                f"each other's checkpoints; give this run another job.dump_folder, or stop that run (its lock {path} "
                f"is taken over once {STALE:.0f} s old)"
            )
        logger.info(f"taking over the lock {path} of an earlier run: {reason}")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)
    return path


@contextlib.contextmanager
def dump_folder_lock(folder: str, rank: int):
    """Held by rank 0 around a run; the other ranks hold nothing."""
    if rank != 0:
        yield
        return
    path = take_lock(Path(folder))
    stopped = threading.Event()

    def heartbeat() -> None:
        while not stopped.wait(HEARTBEAT):
            with contextlib.suppress(OSError):
                path.touch()

    beating = threading.Thread(target=heartbeat, name="dump-folder-lock", daemon=True)
    beating.start()
    try:
        yield
    finally:
        stopped.set()
        beating.join()
        if read_holder(path).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
