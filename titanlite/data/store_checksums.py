"""Checksums of a token store's shards, so bit rot inside a `.bin` or `.mask.bin` (valid ids staying valid ids)
stops the run naming the file and the bytes instead of training on other tokens.

prepare writes, beside each shard file, `<file>.xxh3`: the XXH3-64 of every CHUNK_BYTES of it (little-endian
uint64s, one per chunk, the last chunk shorter), and records the chunk size in the manifest ("checksums"). A
reader verifies a chunk the first time this process reads any of its bytes (a bool per chunk remembers it), so
the cost is one hash per 64 KiB per process: XXH3 runs at several GB/s, and a chunk read once is never hashed
again. DataLoader workers receive the store pickled: the sums travel as their file, the flags as they stand.
A store prepared before checksums existed has no "checksums" in its manifest and is read unverified.
"""

from pathlib import Path

import numpy as np
import xxhash

from titanlite.errors import UserError

CHUNK_BYTES = 1 << 16
SUFFIX = ".xxh3"


def damaged(path: Path, key: str, what: str) -> UserError:
    return UserError(
        f"{key}: {path} {what}; the store is damaged, prepare it again with python -m titanlite.data.prepare"
    )


def sums_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def chunk_sums(data: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """The XXH3-64 of each chunk_bytes of a 1-D array's bytes."""
    raw = data.view(np.uint8)
    return np.fromiter(
        (xxhash.xxh3_64_intdigest(raw[i : i + chunk_bytes]) for i in range(0, len(raw), chunk_bytes)),
        dtype="<u8",
        count=chunk_count(len(raw), chunk_bytes),
    )


def write_chunk_sums(path: Path, data: np.ndarray, write) -> None:
    """`write(path, tofile)` writes a file whole (prepare's write-then-rename)."""
    write(sums_path(path), chunk_sums(data).tofile)


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def recorded_sums(path: Path) -> np.ndarray:
    """The sums recorded beside a shard file, memory-mapped (an empty file maps to nothing, so none)."""
    sums = sums_path(path)
    return np.memmap(sums, dtype="<u8", mode="r") if sums.stat().st_size else np.zeros(0, "<u8")


class ChunkSums:
    """The recorded sums of one shard file and which of its chunks this process has verified; `key` is the config
    key the store came from, for the error."""

    def __init__(self, path: Path, chunk_bytes: int, key: str):
        self.path, self.chunk_bytes, self.key = path, chunk_bytes, key
        self.sums = recorded_sums(path)
        self.verified = np.zeros(len(self.sums), dtype=bool)
        self.unverified = len(self.sums)

    def __getstate__(self) -> dict:
        # To DataLoader workers: the sums as their file (not a copy of them); the flags as they are.
        return {**self.__dict__, "sums": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.sums = recorded_sums(self.path)

    def verify(self, data: np.ndarray, begin: int, end: int) -> None:
        """Verify the chunks holding data[begin:end] (element indices) that this process has not verified yet."""
        if self.unverified == 0 or end <= begin:  # the common case, once a store's chunks have all been read
            return
        first, last = int(begin) * data.itemsize // self.chunk_bytes, (int(end) * data.itemsize - 1) // self.chunk_bytes
        if first == last and self.verified[first]:  # a read within one chunk read before: no numpy call
            return
        raw = data.view(np.uint8)
        for chunk in range(first, last + 1):
            if not self.verified[chunk]:
                self.check_chunk(raw, chunk)

    def verify_at(self, data: np.ndarray, indices: np.ndarray) -> None:
        """Verify the chunks holding data[indices]."""
        if self.unverified == 0:
            return
        chunks = np.unique(indices * data.itemsize // self.chunk_bytes)
        raw = data.view(np.uint8)
        for chunk in chunks[~self.verified[chunks]]:
            self.check_chunk(raw, int(chunk))

    def check_chunk(self, raw: np.ndarray, chunk: int) -> None:
        begin = chunk * self.chunk_bytes
        end = min(begin + self.chunk_bytes, len(raw))
        if xxhash.xxh3_64_intdigest(raw[begin:end]) != int(self.sums[chunk]):
            raise damaged(
                self.path,
                self.key,
                f"bytes {begin}..{end - 1} do not match their checksum in "
                f"{sums_path(self.path).name} (recorded by prepare): one of the two files "
                "changed on disk",
            )
        self.verified[chunk] = True
        self.unverified -= 1
