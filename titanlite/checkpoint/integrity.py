"""A checksum per checkpoint file, so a file damaged on disk (bit rot, a bad copy, a truncated transfer)
is found at load and named, instead of loading silently wrong weights.

After a save, each rank records the 64-bit XXH3 hash of the `.distcp` files it wrote (rank 0 also the `.metadata`)
in `<step>/checksums/rank<R>.json`; an async save does it on its own writer thread, after the write, so
training never waits for it. A load first verifies every recorded file, the ranks sharing the reading, and
stops in one sentence naming the first damaged file.

A save creates the empty `checksums/` folder before it writes anything, so a checkpoint without one cannot be
verified at all: its records were lost, or another tool (or a titanlite before checksums) wrote it. It is refused
in one sentence unless checkpoint.allow_unverified says to load it as it is. A save cut off after its `.metadata`
but before a rank's record (kill -9 while it hashes) has the folder but no record for that rank's files: those
load unverified, with a warning naming them (their sizes are still DCP's).
"""

import json
import mmap
from pathlib import Path

import torch.distributed as dist
import xxhash

from titanlite.errors import UserError
from titanlite.log import logger

CHECKSUMS = "checksums"
# XXH3 rather than CRC-32: both find any bit rot a disk makes, and XXH3 hashes about 7 GB/s on one core
# against CRC-32's 2.4 (the 71 MB debug checkpoint in memory, on the 2-core CI machine). The file is mapped,
# not read: copying it out of the page cache in chunks cost more than hashing it (0.8 GB/s read, 2.3 mapped).


def file_hash(path: Path) -> str:
    if path.stat().st_size == 0:
        return xxhash.xxh3_64(b"").hexdigest()  # mmap cannot map an empty file
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return xxhash.xxh3_64(mapped).hexdigest()


def record_checksums(folder: Path, rank: int) -> None:
    """The hash of the files this rank wrote into the step folder, written beside them."""
    written = sorted(p for p in folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        written.append(folder / ".metadata")
    sums = {p.name: file_hash(p) for p in written if p.is_file()}
    (folder / CHECKSUMS).mkdir(exist_ok=True)
    record = folder / CHECKSUMS / f"rank{rank}.json"
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(sums, indent=0))
    partial.replace(record)  # whole or absent, never half a record


def recorded_checksums(folder: Path) -> dict[str, str]:
    recorded = {}
    for record in sorted((folder / CHECKSUMS).glob("rank*.json")):
        try:
            sums = json.loads(record.read_text())
            if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
                raise ValueError("not a table of checksums")
        except (ValueError, UnicodeDecodeError, OSError) as error:
            raise UserError(
                f"checkpoint checksum record {record} is damaged ({type(error).__name__}); the checkpoint "
                f"cannot be verified: delete {folder} or set checkpoint.load_step to an earlier step"
            ) from None
        recorded.update(sums)
    return recorded


def damaged_files(folder: Path, names: list[str], recorded: dict[str, str]) -> list[str]:
    return [name for name in names if not (folder / name).is_file() or file_hash(folder / name) != recorded[name]]


def data_files(folder: Path) -> list[str]:
    """The files a checkpoint's checksums cover: DCP's data files and its .metadata."""
    return sorted(p.name for p in folder.glob("*.distcp")) + [".metadata"]


def verifiable(folder: Path, allow_unverified: bool) -> bool:
    """Whether the checkpoint can be verified; a checkpoint without a checksums folder stops the load in one sentence,
    unless `allow_unverified` (checkpoint.allow_unverified) lets it load, said in a warning."""
    if (folder / CHECKSUMS).is_dir():
        return True
    if not allow_unverified:
        raise UserError(
            f"checkpoint {folder} cannot be verified: it has no {CHECKSUMS} folder (lost, or the checkpoint was "
            "written by "
            f"another tool or a titanlite before checksums), so damage in its files would load unnoticed; restore that "
            f"folder, delete {folder} (an earlier checkpoint then loads), or set checkpoint.allow_unverified true to "
            "load "
            "it unverified"
        )
    logger.warning(f"checkpoint {folder} has no {CHECKSUMS} folder: it loads unverified (checkpoint.allow_unverified)")
    return False


def verify_checksums(folder: Path, allow_unverified: bool) -> None:
    """Every file recorded at save must read back with its checksum; each rank reads a share of them. Files without a
    record are named in a warning; a checkpoint without records at all is refused (verifiable)."""
    if not verifiable(folder, allow_unverified):
        return
    recorded = recorded_checksums(folder)
    unrecorded = [name for name in data_files(folder) if name not in recorded]
    if unrecorded:
        more = f" and {len(unrecorded) - 1} more" if len(unrecorded) > 1 else ""
        logger.warning(
            f"checkpoint {folder}: {unrecorded[0]}{more} {'have' if more else 'has'} no checksum record (the save "
            "was cut off before recording them, or the record was lost), so they load unverified"
        )
    names = sorted(recorded)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    damaged = damaged_files(folder, names[rank::world], recorded)
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, damaged)
        damaged = sorted(name for share in found for name in share)
    more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
    if damaged and not (folder / damaged[0]).is_file():
        raise UserError(
            f"checkpoint {folder} lacks {damaged[0]}{more}, which {folder / CHECKSUMS} records as saved: a file "
            f"was lost or a record damaged; delete {folder} (an earlier checkpoint then loads) or set "
            "checkpoint.load_step to an earlier step"
        )
    if damaged:
        raise UserError(
            f"checkpoint file {folder / damaged[0]}{more} does not match the checksum recorded when it was saved: its "
            f"bytes changed on disk; delete {folder} (an earlier checkpoint then loads) or set checkpoint.load_step to "
            "an earlier step"
        )


def refuse_lost_metadata(folder: Path) -> None:
    """A step folder without .metadata is a save that never finished, unless a checksum record lists its .metadata:
    records are written after it, and removed before it (folders.remove_checkpoint, a step saved again), so then the
    file was lost on disk, and resuming from an older step without a word would drop the newest checkpoint."""
    recorded = recorded_checksums(folder) if (folder / CHECKSUMS).is_dir() else {}
    if ".metadata" in recorded:
        raise UserError(
            f"checkpoint {folder} has lost its .metadata, which {folder / CHECKSUMS} records as saved: the "
            f"folder is damaged; restore the file, or delete {folder} to resume from the checkpoint before it"
        )
