"""A token store: a corpus tokenized once (python -m titanlite.data.prepare), read memory-mapped.

A store is a folder:

    manifest.json        tokenizer (file name, sha256, vocab, bos, eos), dtype, documents and tokens per shard
    shard-00000.bin      the token ids of its documents, back to back (uint16 when the vocab fits, else uint32)
    shard-00000.idx.npy  int64 offsets: document d of the shard is tokens[idx[d]:idx[d + 1]]
    shard-00000.mask.bin chat stores only: a uint8 per token, 1 where the token is trained (chat.py)
    shard-00000.bin.xxh3 the XXH3-64 of every 64 KiB of the shard (and .mask.bin.xxh3 of the mask), verified as
                         they are read (store_checksums.py); the manifest keeps each offsets file's XXH3-64
    ...

Each document is stored as packing.py tokenizes it, bos + text + eos, so a store and the raw
files it came from give the same token stream. A chat store (`python -m titanlite.data.prepare
--format chat`) holds rendered conversations and their loss mask; its manifest records the format,
train_on and the chat template's sha256, which a run must match, and the chat store version.
"""

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from titanlite.data.store_checksums import ChunkSums, chunk_count, damaged, sums_path
from titanlite.errors import UserError
from titanlite.log import logger

MANIFEST = "manifest.json"
FORMAT = "titanlite-token-store-1"
# A chat store's manifest records the version of the chat windows it was prepared for. 2: every template's
# conversations are packed best-fit, each window carrying its conversations' starts (before, only those that began
# with a bos were packed); a store without one is version 1 and is prepared again rather than read another way.
CHAT_STORE_VERSION = 2


def shard_paths(folder: Path, shard: int) -> tuple[Path, Path]:
    """(tokens file, document-offsets file) of one shard."""
    return folder / f"shard-{shard:05d}.bin", folder / f"shard-{shard:05d}.idx.npy"


def mask_path(folder: Path, shard: int) -> Path:
    """The trained-token flags of one shard of a chat store."""
    return folder / f"shard-{shard:05d}.mask.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_record(tokenizer) -> dict:
    """What a manifest keeps of the tokenizer: enough to refuse a store made with another one."""
    return {
        "file": str(tokenizer.path),
        "sha256": file_sha256(tokenizer.path),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }


def is_store(path: str | Path, key: str) -> bool:
    """A folder with a manifest is a store; one with a store's shards or plan but no manifest is refused, not read as
    raw documents (a prepare that did not finish, or a manifest deleted)."""
    folder = Path(path)
    if (folder / MANIFEST).is_file():
        return True
    if folder.is_dir() and ((folder / "prepare.json").is_file() or any(folder.glob("shard-*.bin"))):
        raise UserError(
            f"{key} {folder} holds token-store shards but no {MANIFEST} (its prepare did not finish, or the "
            "manifest was deleted); run python -m titanlite.data.prepare again with the same arguments to "
            "finish it"
        )
    return False


@dataclass
class TokenStore:
    """Documents as token arrays: `shards` are 1-D arrays (memory maps, or in memory for raw sources
    tokenized at start); document i is shards[doc_shard[i]][doc_start[i] : doc_start[i] + doc_len[i]]."""

    shards: list
    doc_shard: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    name: str
    masks: list | None = None  # chat stores: per shard, a uint8 per token, 1 where it is trained
    checks: list | None = None  # per shard (its tokens' ChunkSums, its mask's or None); None where nothing was recorded

    def __getstate__(self) -> dict:
        # Sent to DataLoader workers: a memory map travels as its file, not as a copy of its tokens.
        return {**self.__dict__, "shards": portable(self.shards), "masks": portable(self.masks)}

    def __setstate__(self, state: dict) -> None:
        state["shards"], state["masks"] = reopened(state["shards"]), reopened(state["masks"])
        self.__dict__.update(state)

    @property
    def total_tokens(self) -> int:
        return int(self.doc_len.sum())

    def tokens(self, shard: int, begin: int, end: int) -> np.ndarray:
        """Tokens [begin, end) of a shard, their chunks verified against the store's checksums on first read."""
        if self.checks is not None:
            self.checks[shard][0].verify(self.shards[shard], begin, end)
        return self.shards[shard][begin:end]

    def mask(self, shard: int, begin: int, end: int) -> np.ndarray:
        """The trained flags of tokens [begin, end) of a shard of a chat store, verified as tokens() is."""
        if self.checks is not None:
            self.checks[shard][1].verify(self.masks[shard], begin, end)
        return self.masks[shard][begin:end]

    def tokens_at(self, shard: int, positions: np.ndarray) -> np.ndarray:
        """The tokens at these positions of a shard, verified as tokens() is."""
        if self.checks is not None:
            self.checks[shard][0].verify_at(self.shards[shard], positions)
        return self.shards[shard][positions]

    def document(self, doc: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(the first `length` tokens of document doc, their trained flags or None without a mask)."""
        shard, begin = self.doc_shard[doc], self.doc_start[doc]
        mask = None if self.masks is None else self.mask(shard, begin, begin + length)
        return self.tokens(shard, begin, begin + length), mask

    @classmethod
    def from_offsets(
        cls, shards: list, offsets: list[np.ndarray], name: str, masks: list | None = None, checks: list | None = None
    ) -> "TokenStore":
        shard_ids = [np.full(len(o) - 1, i, dtype=np.int32) for i, o in enumerate(offsets)]
        return cls(
            shards,
            np.concatenate(shard_ids),
            np.concatenate([o[:-1] for o in offsets]),
            np.concatenate([np.diff(o) for o in offsets]),
            name,
            masks,
            checks,
        )

    @classmethod
    def tokenize(cls, texts, tokenizer, name: str) -> "TokenStore":
        """An in-memory store of raw documents (a raw source in a mix): tokenized here, once per run."""
        tokens, offsets, _ = concatenate(
            [(tokenizer.encode(text, bos=True, eos=True), None) for text in texts], np.int64
        )
        return cls.from_offsets([tokens], [offsets], name)


def concatenate(
    encoded: list[tuple[list[int], list[bool] | None]], dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Documents as (ids, trained flags, or None for text) -> (their ids back to back in dtype, int64 offsets
    where each starts and the last ends, their flags back to back as uint8 or None): one shard's arrays."""
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in encoded])]).astype(np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in encoded), dtype=dtype, count=int(offsets[-1]))
    if not encoded or encoded[0][1] is None:
        return tokens, offsets, None
    flags = np.fromiter(
        itertools.chain.from_iterable(flags for _, flags in encoded), dtype=np.uint8, count=int(offsets[-1])
    )
    return tokens, offsets, flags


def portable(arrays: list | None) -> list | None:
    return (
        None
        if arrays is None
        else [(a.filename, a.dtype.str, a.shape) if isinstance(a, np.memmap) else a for a in arrays]
    )


def reopened(arrays: list | None) -> list | None:
    return (
        None
        if arrays is None
        else [np.memmap(a[0], dtype=a[1], mode="r", shape=a[2]) if isinstance(a, tuple) else a for a in arrays]
    )


def read_manifest(folder: Path, key: str) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{key} {folder}: its {MANIFEST} cannot be read ({error}); prepare the store again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(
            f"{key} {folder}: {MANIFEST} is not a {FORMAT} manifest; prepare the store again with python -m "
            "titanlite.data.prepare"
        )
    check_manifest_fields(manifest, folder, key)
    return manifest


def check_manifest_fields(manifest: dict, folder: Path, key: str) -> None:
    """Every field open_store reads, of the type it reads: an edited manifest is one sentence, not a KeyError."""
    tokenizer, shards = manifest.get("tokenizer"), manifest.get("shards")
    problem = None
    if not isinstance(tokenizer, dict) or not all(
        isinstance(tokenizer.get(k), t) for k, t in (("file", str), ("sha256", str), ("vocab_size", int))
    ):
        problem = "its tokenizer record (file, sha256, vocab_size) is missing or damaged"
    elif manifest.get("dtype") not in ("uint16", "uint32"):
        problem = f"its dtype {manifest.get('dtype')!r} is not uint16 or uint32"
    elif np.dtype(manifest["dtype"]) != token_dtype(tokenizer["vocab_size"]):
        problem = (
            f"its dtype {manifest['dtype']} is not the one prepare writes for a vocabulary of {tokenizer['vocab_size']}"
        )
    elif not isinstance(shards, list) or not all(
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("documents", "tokens"))
        for entry in shards
    ):
        problem = "its shards list (documents and tokens per shard) is missing or damaged"
    elif "checksums" in manifest and not checksums_recorded(manifest["checksums"], shards):
        problem = "its checksums record (algorithm, chunk_bytes, each shard's index_xxh3) is damaged"
    if problem:
        raise UserError(f"{key} {folder}: {MANIFEST} does not describe a store ({problem}); prepare the store again")


def checksums_recorded(checksums, shards: list) -> bool:
    """The manifest's "checksums" as prepare writes it: XXH3-64 of chunks of a positive size, an offsets-file hash per
    shard."""
    return (
        isinstance(checksums, dict)
        and checksums.get("algorithm") == "xxh3_64"
        and len(checksums) == 2
        and isinstance(checksums.get("chunk_bytes"), int)
        and checksums["chunk_bytes"] > 0
        and all(isinstance(entry.get("index_xxh3"), str) for entry in shards)
    )


def shard_max_id(tokens: np.ndarray) -> int:
    """The largest token id of a shard (-1 when empty): the manifest records it so that opening checks it unread."""
    return int(tokens.max()) if len(tokens) else -1


def check_tokenizer(manifest: dict, tokenizer, folder: Path, key: str) -> None:
    """One sentence naming both tokenizers when the run's differs from the store's."""
    prepared, ours = manifest["tokenizer"], tokenizer_record(tokenizer)
    if prepared["sha256"] != ours["sha256"]:
        raise UserError(
            f"{key} {folder} was prepared with the tokenizer {prepared['file']} (sha256 {prepared['sha256'][:12]}) but "
            "this run "
            f"uses {ours['file']} (sha256 {ours['sha256'][:12]}); set model.tokenizer_path to the store's tokenizer or "
            f"prepare the data again with --tokenizer {ours['file']}"
        )


def check_chat(manifest: dict, chat: dict | None, folder: Path, key: str) -> None:
    """A chat store's mask was fixed when it was prepared: the run must read it as it was made, by the titanlite
    whose windows its version names."""
    prepared = manifest.get("chat")
    if prepared is not None and chat is not None and prepared.get("version", 1) != CHAT_STORE_VERSION:
        raise UserError(
            f"{key} {folder} is a chat store prepared by an earlier titanlite (chat store version "
            f"{prepared.get('version', 1)}, this one reads {CHAT_STORE_VERSION}); prepare it again with python -m "
            f"titanlite.data.prepare --format {prepared['format']} --train_on {prepared['train_on']}"
        )
    if prepared is not None:
        prepared = {name: value for name, value in prepared.items() if name != "version"}
    if prepared == chat:
        return
    if chat is None:
        raise UserError(
            f"{key} {folder} holds {prepared['format']} data with its loss mask; set training.dataset_format "
            f"{prepared['format']} and training.train_on {prepared['train_on']}"
        )
    if prepared is None:
        raise UserError(
            f"{key} {folder} holds text without a loss mask; prepare the records with python -m "
            f"titanlite.data.prepare --format {chat['format']}, or point {key} at the jsonl/json/parquet records"
        )
    differences = ", ".join(
        f"{name} {prepared[name]!r} (this run: {chat[name]!r})" for name in chat if prepared[name] != chat[name]
    )
    raise UserError(
        f"{key} {folder} was prepared with {differences}; prepare it again with this run's settings or match them"
    )


def open_store(
    folder: str | Path, tokenizer, key: str = "training.dataset_path", chat: dict | None = None
) -> TokenStore:
    """The store at folder, memory-mapped (read-only: pages are shared by every process on the node). `chat`
    is the run's chat.chat_record (None for text), which a chat store's must equal."""
    folder = Path(folder)
    manifest = read_manifest(folder, key)
    check_tokenizer(manifest, tokenizer, folder, key)
    check_chat(manifest, chat, folder, key)
    chunk_bytes = manifest["checksums"]["chunk_bytes"] if "checksums" in manifest else None
    if chunk_bytes is None:
        logger.info(
            f"{key} {folder} was prepared before token stores recorded checksums: its shards are read unverified "
            "(prepare it again to have them verified)"
        )
    dtype = np.dtype(manifest["dtype"])
    shards, offsets, masks, checks = [], [], [], []
    for shard, entry in enumerate(manifest["shards"]):
        data = [shard_paths(folder, shard)[0], *([mask_path(folder, shard)] if chat is not None else [])]
        index = shard_paths(folder, shard)[1]
        check_files(data, [entry["tokens"] * dtype.itemsize, entry["tokens"]], index, chunk_bytes, entry, folder, key)
        shards.append(np.memmap(data[0], dtype=dtype, mode="r", shape=(entry["tokens"],)))
        offsets.append(checked_offsets(index, entry, folder, key))
        check_ids(shards[-1], entry, manifest["tokenizer"]["vocab_size"], data[0], key)
        if chat is not None:
            masks.append(np.memmap(data[1], dtype=np.uint8, mode="r", shape=(entry["tokens"],)))
        if chunk_bytes is not None:
            checks.append(tuple(ChunkSums(path, chunk_bytes, key) for path in data) + (None,) * (2 - len(data)))
    if not shards or sum(entry["documents"] for entry in manifest["shards"]) == 0:
        raise UserError(f"{key} {folder} holds no documents; prepare it from a source that has some")
    return TokenStore.from_offsets(
        shards, offsets, str(folder), masks if chat is not None else None, checks if chunk_bytes is not None else None
    )


def check_files(
    data: list[Path], sizes: list[int], index: Path, chunk_bytes: int | None, entry: dict, folder: Path, key: str
) -> None:
    """A shard's files are all there (its tokens, a chat store's mask, their checksums, its offsets), each of the
    size its manifest entry gives (`sizes`: of the tokens and the mask)."""
    sums = [sums_path(path) for path in data] if chunk_bytes is not None else []
    missing = next((path for path in [*data, index, *sums] if not path.is_file()), None)
    if missing:
        raise UserError(f"{key} {folder}: {missing.name} is missing; prepare the store again")
    for path, size in zip(data, sizes):
        check_size(path, size, f"{entry['tokens']} tokens of {size // max(entry['tokens'], 1)} byte(s)", folder, key)
    for path, size in zip(sums, sizes):
        check_size(
            path,
            8 * chunk_count(size, chunk_bytes),
            f"{entry['tokens']} tokens, one checksum per {chunk_bytes} bytes",
            folder,
            key,
        )


def check_size(path: Path, expected: int, described: str, folder: Path, key: str) -> None:
    size = path.stat().st_size
    if size != expected:
        raise damaged(path, key, f"holds {size} bytes but {folder / MANIFEST} says {described} ({expected} bytes)")


def checked_offsets(path: Path, entry: dict, folder: Path, key: str) -> np.ndarray:
    """A shard's document offsets, checked against its manifest entry: documents + 1 int64 offsets from 0 to its
    token count, never decreasing (so that no document reads outside the shard), and the file's XXH3-64 the manifest
    recorded (a store with checksums)."""
    if "index_xxh3" in entry and xxhash.xxh3_64(path.read_bytes()).hexdigest() != entry["index_xxh3"]:
        raise damaged(path, key, f"does not match the checksum {folder / MANIFEST} recorded: the file changed on disk")
    try:
        offsets = np.load(path)  # allow_pickle is off: a garbled file is a ValueError, never unpickled
    except (OSError, ValueError, EOFError) as error:
        raise damaged(path, key, f"cannot be read as document offsets ({error})") from None
    if offsets.dtype != np.int64 or offsets.shape != (entry["documents"] + 1,):
        raise damaged(
            path,
            key,
            f"holds {offsets.dtype} offsets of shape {offsets.shape}, not the {entry['documents'] + 1} "
            f"int64 offsets of the {entry['documents']} documents {folder / MANIFEST} lists",
        )
    if offsets[0] != 0 or offsets[-1] != entry["tokens"] or (np.diff(offsets) < 0).any():
        raise damaged(path, key, f"has document offsets outside 0..{entry['tokens']} or out of order")
    return offsets


def check_ids(tokens: np.ndarray, entry: dict, vocab_size: int, path: Path, key: str) -> None:
    """Every id is below the tokenizer's vocabulary (which the model's holds): the manifest's max_id, or for a store
    prepared before it was recorded, the shard's own maximum. An id past the embedding would be a CUDA device assert
    mid-run."""
    max_id = entry.get("max_id")
    max_id = shard_max_id(tokens) if not isinstance(max_id, int) else max_id
    if max_id >= vocab_size:
        raise damaged(path, key, f"holds token id {max_id} but its tokenizer has {vocab_size} ids")
