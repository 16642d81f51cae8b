"""A save that fails for want of space or permission becomes one sentence, not DCP's traceback.

DCP reports a failed write as a CheckpointException holding each rank's error, and a full disk
often reaches it as torch's zip writer's "unexpected pos" RuntimeError with no errno at all; so
the errno is looked for through the whole chain, and a write that failed while the disk has less
room than one checkpoint is taken for a full disk.
"""

import errno
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from titanlite.checkpoint.folders import list_steps, remove_checkpoint, step_folder
from titanlite.errors import UserError

DISK_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # the fix is free space, not permissions


def _errors_in(error: BaseException) -> list[BaseException]:
    """The error, every rank's error inside a CheckpointException, and their causes."""
    found, todo = [], [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            todo += [failure for failure, _trace in current.failures.values()]
        todo += [current.__cause__, current.__context__]
    return found


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def checkpoint_bytes(root: Path, estimate: int) -> int:
    """The size of the newest complete checkpoint (the best guess at the next one), else `estimate`."""
    complete, _ = list_steps(root)
    return folder_bytes(step_folder(root, complete[-1])) if complete else estimate


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def disk_failure(error: BaseException, root: Path, needed: int) -> int | None:
    """The errno (one of DISK_ERRORS) when the disk or its permissions made the save fail, else None."""
    for cause in _errors_in(error):
        if isinstance(cause, OSError) and cause.errno in DISK_ERRORS:
            return cause.errno
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    return errno.ENOSPC if free < needed else None


def stop_if_disk_failure(error: BaseException, root: Path, step: int, estimate: int, rank: int) -> None:
    """A full disk, a read-only filesystem or a denied write: drop the partial folder (never complete: it
    has no .metadata) to give its space back, and stop with one sentence. `estimate`: the bytes of one
    checkpoint when none is on disk yet."""
    needed = checkpoint_bytes(root, estimate)
    code = disk_failure(error, root, needed)
    if code is None:
        return
    if rank == 0:
        remove_checkpoint(step_folder(root, step))
    fix = f"free at least {gib(needed)} there (the size of one checkpoint)" if code in NO_SPACE else "make it writable"
    raise UserError(
        f"checkpoint step-{step} could not be written to {root}: {DISK_ERRORS[code]}; {fix} or set job.dump_folder to "
        "another disk, "
        f"then start the run again: it stopped without saving step {step}, and the earlier checkpoints are untouched"
    ) from None
