"""Checkpoint folders on disk: `<folder>/step-N`, complete only once DCP has written `.metadata`.

DCP writes every rank's data files first and renames `.metadata` into place last, so a folder
without it is a save that was interrupted (a crash, kill -9, a node lost) and is never loaded.
Deleting goes the other way round: `.metadata` first, so a half-deleted folder is incomplete too.
"""

import re
import shutil
from pathlib import Path

METADATA = ".metadata"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


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
    """Make the folder incomplete first (one unlink), then delete the rest."""
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
