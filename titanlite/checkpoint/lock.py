"""One run per dump folder: two runs started into one `job.dump_folder` would overwrite each other's
checkpoints. Rank 0 holds `<dump_folder>/.titanlite.lock`, a JSON record of its host, pid, start time and
job (Slurm's or torchrun's id), and touches it every HEARTBEAT seconds while it runs; it removes it at exit.

A second run finding the lock stops in one sentence, unless the lock is stale: its process is gone (same
host, pid not alive), it was not touched for STALE seconds (a run killed on another host), or it belongs
to the same job (an elastic restart or a requeue of it, whose old rank 0 is gone). A stale lock is taken
over with a log line.

Of any number of runs starting together exactly one takes the lock: it is created with O_EXCL (atomic, NFS
included), and a stale one is judged and rewritten under flock, one taker at a time, so the others then find
it live.
"""

import contextlib
import errno
import fcntl
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


def parse_holder(text: bytes) -> dict:
    try:
        holder = json.loads(text)
        return holder if isinstance(holder, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}  # a half-written or damaged lock says nothing of a live run: it ages into staleness


def read_holder(path: Path) -> dict:
    try:
        return parse_holder(path.read_bytes())
    except OSError:
        return {}


def refusal(folder: Path, path: Path, holder: dict) -> UserError:
    return UserError(
        f"job.dump_folder {folder} is in use by another run (host {holder.get('host', '?')}, pid "
        f"{holder.get('pid', '?')}, started {holder.get('started', '?')}): two runs in one folder would overwrite "
        f"each other's checkpoints; give this run another job.dump_folder, or stop that run (its lock {path} "
        f"is taken over once {STALE:.0f} s old)"
    )


def serialized(file, folder: Path) -> None:
    """flock the lock file: the takers of a stale lock judge and rewrite it one at a time. A file system without
    flock (Lustre mounted without -o flock) takes over unserialized, as it says."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX)
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        logger.warning(f"the file system of job.dump_folder {folder} has no flock ({error.strerror}): two runs taking "
                       "over its stale lock at the same moment could both take it")


def take_over_if_stale(folder: Path, path: Path, record: bytes) -> bool:
    """Rewrite the lock `path` with `record` if its run is gone; False where the file went away meanwhile (its run
    ended: create it anew). Refuses where its run may still be running."""
    try:
        file = open(path, "r+b")
    except FileNotFoundError:
        return False
    with file:
        serialized(file, folder)
        try:
            if os.stat(path).st_ino != os.fstat(file.fileno()).st_ino:
                return False  # removed and created anew since we opened it: judge the new one
        except FileNotFoundError:
            return False
        holder, age = parse_holder(file.read()), time.time() - os.fstat(file.fileno()).st_mtime
        reason = stale_reason(holder, age)
        if reason is None:
            raise refusal(folder, path, holder)
        logger.info(f"taking over the lock {path} of an earlier run: {reason}")
        file.seek(0)
        file.truncate()
        file.write(record)
    return True


def take_lock(folder: Path) -> Path:
    """Exactly one of any number of runs starting together takes the lock: it is created exclusively (O_EXCL), and a
    stale one is taken over under flock; every other run is refused in one sentence."""
    path = folder / LOCK
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    while True:
        try:
            created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if take_over_if_stale(folder, path, record):
                return path
            continue
        with open(created, "wb") as file:
            file.write(record)
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
            release(path)


def release(path: Path) -> None:
    """Remove the lock; where that fails (the folder turned read-only) the run's own error still comes first, and the
    next run takes the lock over as stale (its process is gone)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning(f"the lock {path} could not be removed ({error.strerror}); the next run takes it over as stale")
