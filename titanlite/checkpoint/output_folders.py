"""Start-up check of every folder the run will write, so a bad path stops the run before training
instead of at the first save, hours later.

Each folder is created now (the run would create it anyway) and probed with a temporary file:
that is the only test that is true for root, read-only mounts and network filesystems alike.
"""

import tempfile
from pathlib import Path

from titanlite.config_sections import JobConfig
from titanlite.errors import UserError


def folders_to_write(cfg: JobConfig) -> list[tuple[str, Path]]:
    """(the key that names it, the folder) for every folder this run's settings will write."""
    dump = Path(cfg.job.dump_folder)
    folders = [("job.dump_folder", dump)]
    if cfg.checkpoint.enable or cfg.checkpoint.create_seed_checkpoint:
        folders.append(("checkpoint.folder", dump / cfg.checkpoint.folder))
    if cfg.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", dump / cfg.metrics.save_tb_folder))
    if cfg.profiling.enable_profiling:
        folders.append(("profiling.save_traces_folder", dump / cfg.profiling.save_traces_folder))
    if cfg.profiling.enable_memory_snapshot:
        folders.append(("profiling.save_memory_snapshot_folder", dump / cfg.profiling.save_memory_snapshot_folder))
    if cfg.job.log_rank_files:
        folders.append(("job.log_rank_files", dump / "logs"))
    return folders


def check_writable_folder(key: str, folder: Path) -> None:
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(
            f"{key}: {folder} cannot be a folder because {blocker} is a file; remove that file or choose another path"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UserError(
            f"{key}: {folder} is not a writable folder ({error.strerror}); fix its permissions or mount, or choose "
            "another path"
        ) from None


def check_output_folders(cfg: JobConfig) -> None:
    for key, folder in folders_to_write(cfg):
        check_writable_folder(key, folder)
