"""Checkpoint folders on disk: `<folder>/step-N`, complete only once DCP has written `.metadata`.

DCP writes every rank's data files first and renames `.metadata` into place last, so a folder
without it is a save that was interrupted (a crash, kill -9, a node lost) and is never loaded.
Deleting goes the other way round: `.metadata` first, so a half-deleted folder is incomplete too.

Lineage: the live history is the step folders directly in `<folder>`. A rewind (load_step below
newer checkpoints) moves every newer step folder (complete, incomplete, `-hf` exports) into
`<folder>/abandoned/from-step-L-<time>/` before anything is saved, so "the newest complete" and
retention's "the newest k" only ever see the history the run continues. Nothing there is loaded
or deleted by titanlite; the user deletes it or moves a step back by hand.
"""

import json
import re
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from titanlite.checkpoint.integrity import CHECKSUMS
from titanlite.errors import UserError
from titanlite.log import logger

METADATA = ".metadata"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_ANY_STEP_FOLDER = re.compile(r"^step-(\d+)(-hf)?$")  # checkpoints and their Hugging Face exports
ABANDONED = "abandoned"
REWOUND = "rewound.json"  # the step checkpoint.load_step rewound to, and when


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def is_complete(folder: Path) -> bool:
    return (folder / METADATA).is_file()


def list_steps(root: Path) -> tuple[list[int], list[Path]]:
    """(steps of complete checkpoints, ascending; folders of incomplete ones)."""
    complete, incomplete = [], []
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_FOLDER.match(child.name)
            if match and child.is_dir():
                if is_complete(child):
                    complete.append(int(match.group(1)))
                else:
                    incomplete.append(child)
    return sorted(complete), sorted(incomplete)


def remove_checkpoint(folder: Path) -> None:
    """Make the folder incomplete first (one unlink), then delete the rest. The checksums go before the .metadata:
    a record that lists a .metadata no longer there means damage, never a deletion cut short (integrity.py)."""
    shutil.rmtree(folder / CHECKSUMS, ignore_errors=True)
    (folder / METADATA).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def purge_old(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` complete checkpoints; also drop interrupted saves older than the newest.

    Called only when no save is in flight, so an incomplete folder is never one being written.
    """
    complete, incomplete = list_steps(root)
    newest = complete[-1] if complete else -1
    doomed = [step_folder(root, s) for s in complete[:-keep]] if keep > 0 else []
    doomed += [f for f in incomplete if int(_STEP_FOLDER.match(f.name).group(1)) < newest]
    for folder in doomed:
        remove_checkpoint(folder)
    return doomed


def set_aside_newer(root: Path, step: int) -> tuple[Path, list[str]] | None:
    """Move the step folders newer than `step` to <root>/abandoned/from-step-<step>-<time>/
    (a rewind); returns (that folder, the names moved), or None when there are none."""
    steps = {
        c: int(m.group(1)) for c in (root.iterdir() if root.is_dir() else ()) if (m := _ANY_STEP_FOLDER.match(c.name))
    }
    newer = sorted((c for c, s in steps.items() if s > step), key=steps.get)
    if not newer:
        return None
    aside = root / ABANDONED / f"from-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for folder in newer:
        folder.rename(aside / folder.name)  # same filesystem: one atomic rename, no copy
    return aside, [f.name for f in newer]


def rewound_before(root: Path, step: int) -> str | None:
    """When the run rewound to `step` (checkpoint.load_step) already, or None: a load_step left in a command or
    config.toml rewinds once, not again at every requeue or restart (each would set aside the progress since). A
    damaged record is refused: read as "not rewound", it would set the progress aside again."""
    path = root / REWOUND
    if step == -1 or not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not (isinstance(record, dict) and type(record.get("step")) is int and isinstance(record.get("at"), str)):
            raise ValueError("not a record of a step and a time")
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise UserError(
            f"{path} is damaged ({type(error).__name__}), so whether checkpoint.load_step {step} already "
            f"rewound this run is not known; remove checkpoint.load_step to resume from the newest checkpoint, "
            f"or delete {path} to rewind to step {step} again"
        ) from None
    return record["at"] if record["step"] == step else None


def rewind_to(root: Path, step: int, rank: int) -> None:
    """Resuming from an older step starts a new history: the newer checkpoints move aside (set_aside_newer)
    before anything is saved, so neither a later resume nor retention can take them for this run's. The
    rewind is recorded (rewound_before)."""
    if rank == 0:
        (root / REWOUND).write_text(json.dumps({"step": step, "at": time.strftime("%Y-%m-%d %H:%M:%S")}))
        moved = set_aside_newer(root, step)
        if moved:
            aside, names = moved
            logger.warning(
                f"resuming from step {step}: the newer {', '.join(names)} belong to the abandoned history and were "
                "moved "
                f"to {aside}; they are never loaded or counted by keep_latest_k (move one back into {root} to use it)"
            )
    dist.barrier()  # no rank reads or writes the folder before the move is done
