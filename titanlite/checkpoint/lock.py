"""One run per dump folder: two runs started into one `job.dump_folder` would overwrite each other's
checkpoints. Rank 0 holds `<dump_folder>/.titanlite.lock`, a JSON record of its host, process (pid, start time,
machine) and job, and touches it every HEARTBEAT seconds while it runs; it removes it at exit.

A second run finding the lock stops in one sentence, unless the lock is stale: its process is gone (same machine,
that pid not alive or a later process's), it was not touched for STALE seconds (a run killed on another host), or it
was taken on another host by the same job (an elastic restart or a requeue of it, whose old rank 0 is gone). A live
process on this machine is never taken over, whatever its job says: two jobs are told apart by their processes
first, and by a job id only where one machine cannot see the other's. A job id counts only where no other job shares
it: torchrun's rendezvous id (--standalone's own, or the --rdzv-id given), or Slurm's job and step; torchrun without
--rdzv-id calls every job "none", which is no id. A restarted worker of such a job (TORCHELASTIC_RESTART_COUNT or
SLURM_RESTART_COUNT above 0) that finds a lock taken without an id on another host waits for it to go stale (its
old rank 0 is gone and touches it no more) rather than refuse. A stale lock is taken over with a log line.

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
RESTART_POLL = 2.0  # how often a restarted worker looks again at a lock that may be its own job's (module docstring)
PID_MAX = 1 << 22  # Linux's largest pid_max: a pid outside 1..PID_MAX is a damaged record, not a process to look for


def job_id() -> str:
    """This job's id where no other job can share it, else "" (module docstring)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: Slurm's id would name the whole allocation, not this job
        run = os.environ["TORCHELASTIC_RUN_ID"]
        return "" if run == "none" else f"torchrun {run}"
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm {os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 'batch')}"
    return ""


def restarted() -> bool:
    """Whether this process is a restart of its job by torchrun (--max-restarts) or Slurm (a requeue)."""
    return any(
        os.environ.get(name, "0").strip() not in ("", "0")
        for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


def machine() -> str:
    """This machine (its boot id) and pid namespace (containers on one machine number their processes apart): records
    made under the same one may compare pids. "" without /proc: the host name and pid alone."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """When process `pid` started (clock ticks after boot, /proc's field 22): with the pid, one process and never a
    later one given the same pid; "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else ""


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def holder_alive(holder: dict) -> bool | None:
    """Whether the process that took the lock runs; None where this process cannot see it (another machine or pid
    namespace) or cannot tell it from a later process given the same pid (an older record without its start)."""
    pid = holder.get("pid")
    if type(pid) is not int or not 0 < pid <= PID_MAX:
        return None
    recorded, started_then = holder.get("machine"), holder.get("pid_start")
    here = (
        recorded == machine() if recorded and isinstance(recorded, str) else holder.get("host") == socket.gethostname()
    )
    if not here:
        return None
    if not process_alive(pid):
        return False
    started = process_start(pid)
    return started == started_then if started and started_then and isinstance(started_then, str) else None


def stale_reason(holder: dict, age: float) -> str | None:
    """Why the run that took the lock cannot be running any more; None where it may be."""
    alive = holder_alive(holder)
    if alive is not None:
        return None if alive else f"its process {holder['pid']} on this machine is gone"
    if age > STALE:
        return f"it was last touched {age:.0f} s ago"
    if job_id() and holder.get("job") == job_id():
        return f"it belongs to this job ({job_id()}), restarted"
    return None


def may_be_this_jobs(holder: dict) -> bool:
    """Whether a live-looking lock may be this job's own, taken before its restart on a machine this one cannot see:
    then it goes stale within STALE seconds, and the restart waits for that instead of refusing."""
    return restarted() and not job_id() and not holder.get("job") and holder_alive(holder) is None


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
    then = (
        "or stop that run first (a lock is never taken from a live process on its machine)"
        if holder_alive(holder)
        else f"or stop that run (its lock {path} is taken over once {STALE:.0f} s old)"
    )
    return UserError(
        f"job.dump_folder {folder} is in use by another run (host {holder.get('host', '?')}, pid "
        f"{holder.get('pid', '?')}, job {holder.get('job') or 'without an id'}, started {holder.get('started', '?')}): "
        "two runs in one folder would overwrite each other's checkpoints; give this run another job.dump_folder, "
        f"{then}"
    )


class Held(Exception):
    """The lock belongs to a run that may still be running, whose record this holds."""

    def __init__(self, holder: dict):
        super().__init__()
        self.holder = holder


def serialized(file, folder: Path) -> None:
    """flock the lock file: the takers of a stale lock judge and rewrite it one at a time. A file system without
    flock (Lustre mounted without -o flock) takes over unserialized, as it says."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX)
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        logger.warning(
            f"the file system of job.dump_folder {folder} has no flock ({error.strerror}): two runs taking "
            "over its stale lock at the same moment could both take it"
        )


def take_over_if_stale(folder: Path, path: Path, record: bytes) -> bool:
    """Rewrite the lock `path` with `record` if its run is gone; False where the file went away meanwhile (its run
    ended: create it anew). Raises Held where its run may still be running."""
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
            raise Held(holder)
        logger.info(f"taking over the lock {path} of an earlier run: {reason}")
        file.seek(0)
        file.truncate()
        file.write(record)
    return True


def own_process() -> dict:
    """What names this process in a lock: where it runs and which process it is."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "machine": machine(),
        "pid_start": process_start(os.getpid()),
    }


def take_lock(folder: Path) -> Path:
    """Exactly one of any number of runs starting together takes the lock: it is created exclusively (O_EXCL), and a
    stale one is taken over under flock; every other run is refused in one sentence (a restart of a job without an id
    may first wait for its old lock to go stale: wait_as_a_restart)."""
    path = folder / LOCK
    record = json.dumps(own_process() | {"job": job_id(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    waiting_since = None
    while True:
        try:
            created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                if take_over_if_stale(folder, path, record):
                    return path
            except Held as held:
                waiting_since = wait_as_a_restart(folder, path, held.holder, waiting_since)
            continue
        with open(created, "wb") as file:
            file.write(record)
        return path


def wait_as_a_restart(folder: Path, path: Path, holder: dict, since: float | None) -> float:
    """Wait RESTART_POLL seconds where the lock may be this restarted job's own (may_be_this_jobs), at most until it
    must have gone stale; refuse otherwise. Returns when the wait began."""
    now = time.monotonic()
    if not may_be_this_jobs(holder) or since is not None and now - since > STALE + HEARTBEAT:
        raise refusal(folder, path, holder)
    if since is None:
        logger.info(
            f"the lock {path} was taken on host {holder.get('host', '?')} by a job without an id, perhaps this job "
            f"before its restart: waiting up to {STALE + HEARTBEAT:.0f} s for it to go stale"
        )
    time.sleep(RESTART_POLL)
    return now if since is None else since


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
        holder, own = read_holder(path), own_process()
        if all(holder.get(key) == value for key, value in own.items()):
            release(path)


def release(path: Path) -> None:
    """Remove the lock; where that fails (the folder turned read-only) the run's own error still comes first, and the
    next run takes the lock over as stale (its process is gone)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning(f"the lock {path} could not be removed ({error.strerror}); the next run takes it over as stale")
