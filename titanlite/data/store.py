"""A token store: a corpus tokenized once (python -m titanlite.data.prepare), read memory-mapped.

A store is a folder:

    manifest.json        tokenizer (file name, sha256, vocab, bos, eos), dtype, documents and tokens per shard
    shard-00000.bin      the token ids of its documents, back to back (uint16 when the vocab fits, else uint32)
    shard-00000.idx.npy  int64 offsets: document d of the shard is tokens[idx[d]:idx[d + 1]]
    ...

Each document is stored as packing.py tokenizes it, bos + text + eos, so a store and the raw
files it came from give the same token stream.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlite.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "titanlite-token-store-1"


def shard_paths(folder: Path, shard: int) -> tuple[Path, Path]:
    """(tokens file, document-offsets file) of one shard."""
    return folder / f"shard-{shard:05d}.bin", folder / f"shard-{shard:05d}.idx.npy"


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
    return {"file": str(tokenizer.path), "sha256": file_sha256(tokenizer.path), "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def is_store(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


@dataclass
class TokenStore:
    """Documents as token arrays: `shards` are 1-D arrays (memory maps, or in memory for raw sources
    tokenized at start); document i is shards[doc_shard[i]][doc_start[i] : doc_start[i] + doc_len[i]]."""

    shards: list
    doc_shard: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    name: str

    def __getstate__(self) -> dict:
        # Sent to DataLoader workers: a memory map travels as its file, not as a copy of its tokens.
        shards = [(s.filename, s.dtype.str, s.shape) if isinstance(s, np.memmap) else s for s in self.shards]
        return {**self.__dict__, "shards": shards}

    def __setstate__(self, state: dict) -> None:
        state["shards"] = [np.memmap(s[0], dtype=s[1], mode="r", shape=s[2]) if isinstance(s, tuple) else s
                           for s in state["shards"]]
        self.__dict__.update(state)

    @property
    def total_tokens(self) -> int:
        return int(self.doc_len.sum())

    @classmethod
    def from_offsets(cls, shards: list, offsets: list[np.ndarray], name: str) -> "TokenStore":
        shard_ids = [np.full(len(o) - 1, i, dtype=np.int32) for i, o in enumerate(offsets)]
        return cls(shards, np.concatenate(shard_ids), np.concatenate([o[:-1] for o in offsets]),
                   np.concatenate([np.diff(o) for o in offsets]), name)

    @classmethod
    def tokenize(cls, texts, tokenizer, name: str) -> "TokenStore":
        """An in-memory store of raw documents (a raw source in a mix): tokenized here, once per run."""
        ids = [np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype=np.int64) for text in texts]
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in ids])])
        return cls.from_offsets([np.concatenate(ids)], [offsets], name)


def read_manifest(folder: Path, key: str) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{key} {folder}: its {MANIFEST} cannot be read ({error}); prepare the store again") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{key} {folder}: {MANIFEST} is not a {FORMAT} manifest; prepare the store again with python -m titanlite.data.prepare")
    return manifest


def check_tokenizer(manifest: dict, tokenizer, folder: Path, key: str) -> None:
    """One sentence naming both tokenizers when the run's differs from the store's."""
    prepared, ours = manifest["tokenizer"], tokenizer_record(tokenizer)
    if prepared["sha256"] != ours["sha256"]:
        raise UserError(
            f"{key} {folder} was prepared with the tokenizer {prepared['file']} (sha256 {prepared['sha256'][:12]}) but this run "
            f"uses {ours['file']} (sha256 {ours['sha256'][:12]}); set model.tokenizer_path to the store's tokenizer or "
            f"prepare the data again with --tokenizer {ours['file']}"
        )


def open_store(folder: str | Path, tokenizer, key: str = "training.dataset_path") -> TokenStore:
    """The store at folder, memory-mapped (read-only: pages are shared by every process on the node)."""
    folder = Path(folder)
    manifest = read_manifest(folder, key)
    check_tokenizer(manifest, tokenizer, folder, key)
    shards, offsets = [], []
    for shard, entry in enumerate(manifest["shards"]):
        tokens_path, index_path = shard_paths(folder, shard)
        if not tokens_path.is_file() or not index_path.is_file():
            raise UserError(f"{key} {folder}: shard {shard} is missing ({tokens_path.name}); prepare the store again")
        shards.append(np.memmap(tokens_path, dtype=manifest["dtype"], mode="r", shape=(entry["tokens"],)))
        offsets.append(np.load(index_path))
    if not shards or sum(entry["documents"] for entry in manifest["shards"]) == 0:
        raise UserError(f"{key} {folder} holds no documents; prepare it from a source that has some")
    return TokenStore.from_offsets(shards, offsets, str(folder))
