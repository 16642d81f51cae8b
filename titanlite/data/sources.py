"""The sources of a global-order loader: one token store (dataset_path), or the weighted sources of
training.dataset_mix, each a store or raw data files.

A raw source in a mix is tokenized here, at start, into an in-memory store, so that it too is
read by global window index (fine for small corpora; prepare large ones into a store once).
"""

from pathlib import Path

from titanlite.data.global_order import MixedWindows, StoreWindows
from titanlite.data.local_files import load_local_documents
from titanlite.data.store import TokenStore, is_store, open_store
from titanlite.errors import UserError
from titanlite.log import logger


def open_source(path: str, tokenizer, text_field: str, key: str) -> TokenStore:
    if is_store(path, key):
        return open_store(path, tokenizer, key)
    texts = load_local_documents(path, text_field, key)
    logger.info(
        f"{key} {path} holds raw documents: tokenizing its {len(texts):,} documents now (prepare it into a "
        "token store with python -m titanlite.data.prepare to skip this)"
    )
    return TokenStore.tokenize(texts, tokenizer, path)


def normalised_weights(weights: list[float]) -> list[float]:
    total = sum(weights)
    if abs(total - 1) > 1e-9:
        shares = ", ".join(f"{w / total:.4g}" for w in weights)
        logger.info(f"training.dataset_mix weights sum to {total:g}, not 1; normalised to {shares}")
    return [w / total for w in weights]


def global_windows(
    dataset_path: str, dataset_mix: list, tokenizer, text_field: str, seq_len: int, seed: int, section: str
) -> tuple[StoreWindows | MixedWindows, dict, list[str]]:
    """(the windows, the stream's identity for checkpoints, a name per source for metrics)."""
    if not dataset_mix:
        store = open_store(dataset_path, tokenizer, f"{section}.dataset_path")
        identity = {"sources": [str(Path(dataset_path).resolve())], "seed": seed, "seq_len": seq_len}
        return StoreWindows(store, seq_len, seed), identity, [Path(dataset_path).name]
    empty = next((i for i, entry in enumerate(dataset_mix) if not entry.path), None)
    if empty is not None:
        raise UserError(f'training.dataset_mix[{empty}] has no path; give it path = "<store folder or data file>"')
    sources = [
        open_source(entry.path, tokenizer, text_field, f"training.dataset_mix[{i}].path")
        for i, entry in enumerate(dataset_mix)
    ]
    weights = normalised_weights([entry.weight for entry in dataset_mix])
    # Each source has a permutation stream of its own (seed, source number), so adding a source
    # does not reorder the others.
    windows = [StoreWindows(store, seq_len, seed + 1 + i) for i, store in enumerate(sources)]
    identity = {
        "sources": [str(Path(e.path).resolve()) for e in dataset_mix],
        "weights": weights,
        "seed": seed,
        "seq_len": seq_len,
    }
    names = [f"{i}_{Path(entry.path).name}" for i, entry in enumerate(dataset_mix)]
    return MixedWindows(windows, weights, seed), identity, names
