"""Chat data in one global order: whole conversations packed into windows, the same at any scale.

Epoch e lays the conversations out in the order of a permutation drawn from (seed, e) and packs
them greedily and whole into windows of seq_len + 1 tokens: a conversation that does not fit in
what is left of a window starts the next one, and the rest of the window is eos padding outside
the loss. Packed conversations are told apart by the bos each starts with (models/attention.py's
document_ids); a conversation is tokenized exactly as the template renders it, so where the template
writes no bos of its own (Qwen's ChatML) nothing tells two apart, and each window holds one conversation. One longer than a window is truncated to it (never split over two); one with no trained
label in its first window is left out. Window g of the stream is window g - (the windows of the
earlier epochs) of its epoch, so it depends on (seed, g) alone, and global_order.py's loader deals
the windows to the ranks exactly as it deals a token store's: any split of the global batch into
ranks, local batch and accumulation reads the same conversations.
"""

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.data.documents import seeded_rng
from titanlite.data.packing import split_window
from titanlite.data.store import TokenStore
from titanlite.errors import UserError
from titanlite.log import logger

IGNORED = -100  # the label of a token outside the loss (cross_entropy's ignore_index)


def trained_counts(store: TokenStore, lengths: np.ndarray) -> np.ndarray:
    """Trained tokens within the first lengths[d] tokens of each document d, one shard at a time."""
    counts = np.zeros(len(lengths), dtype=np.int64)
    for shard, mask in enumerate(store.masks):
        docs = np.flatnonzero(store.doc_shard == shard)
        running = np.concatenate([[0], np.cumsum(store.mask(shard, 0, len(mask)), dtype=np.int64)])
        starts = store.doc_start[docs]
        counts[docs] = running[starts + lengths[docs]] - running[starts]
    return counts


def starts_with(store: TokenStore, token: int | None) -> bool:
    """Whether every document of the store starts with this token."""
    if token is None:
        return False
    return all(bool((store.tokens_at(i, store.doc_start[(store.doc_shard == i) & (store.doc_len > 0)]) == token).all())
               for i in range(len(store.shards)))


def pack(lengths: np.ndarray, window: int) -> np.ndarray:
    """Greedy whole packing of documents of these lengths (each at most `window`), in order: the index
    of each window's first document, then len(lengths)."""
    starts, filled = [0], 0
    for i, length in enumerate(lengths.tolist()):
        if filled + length > window:
            starts.append(i)
            filled = 0
        filled += length
    starts.append(len(lengths))
    return np.asarray(starts)


class ConversationWindows(Dataset):
    """Window g of a chat store (tokens with a loss mask) as (inputs, labels), labels IGNORED where not trained."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, pad_id: int, key: str, bos_id: int | None = None):
        self.store, self.window_len, self.seed, self.pad_id = store, seq_len + 1, seed, pad_id
        self.lengths = np.minimum(store.doc_len, self.window_len)
        counts = trained_counts(store, self.lengths)
        self.kept = np.flatnonzero(counts > 0)
        where, seq_key = f"{key} {store.name}", f"{key.split('.')[0]}.seq_len"  # training's or validation's
        if not len(self.kept):
            raise UserError(f"{where}: no conversation has a trained token within its first {seq_key} + 1 = "
                            f"{self.window_len} tokens; raise {seq_key} or check training.train_on")
        truncated = int((store.doc_len > self.window_len).sum())
        if truncated:
            logger.info(f"{where}: {truncated:,} of {len(store.doc_len):,} conversations are longer than {seq_key} + 1 = "
                        f"{self.window_len} tokens and are truncated to one window")
        if len(self.kept) < len(store.doc_len):
            logger.info(f"{where}: {len(store.doc_len) - len(self.kept):,} conversations hold no trained token within one "
                        "window (truncated before any) and are left out")
        self.packed = starts_with(store, bos_id) and bos_id != pad_id
        if not self.packed:
            fill = self.lengths[self.kept].sum() / (len(self.kept) * self.window_len)
            logger.info(f"{where}: one conversation per window ({fill:.0%} of the tokens are conversation, the rest padding): "
                        "the conversations do not start with a bos of their own that would tell packed ones apart")
        self.epoch_windows: list[int] = []  # how many windows each epoch packs, as far as laid out
        self.plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        logger.info(f"{where}: an epoch is {self.windows_per_epoch():,} windows of {self.window_len} tokens, "
                    f"{len(self.kept):,} conversations with {int(counts[self.kept].sum()):,} trained tokens")

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the conversations in this epoch's order, pack's window starts into it); the last two are kept."""
        if epoch not in self.plans:
            order = self.kept[seeded_rng(self.seed, epoch).permutation(len(self.kept))]
            self.plans = {e: v for e, v in self.plans.items() if e == epoch - 1}
            self.plans[epoch] = order, pack(self.lengths[order], self.window_len) if self.packed else np.arange(len(order) + 1)
        return self.plans[epoch]

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, window within it) of global window g."""
        epoch, first = 0, 0
        while True:
            if epoch == len(self.epoch_windows):
                self.epoch_windows.append(len(self.plan(epoch)[1]) - 1)
            if g < first + self.epoch_windows[epoch]:
                return epoch, g - first
            first, epoch = first + self.epoch_windows[epoch], epoch + 1

    def windows_per_epoch(self) -> int:
        self.locate(0)  # lays out epoch 0
        return self.epoch_windows[0]

    def windows_in(self, epochs: float) -> int:
        """The windows of the first `epochs` passes: every epoch packs its own order, so each counts its own."""
        whole = int(epochs)
        while len(self.epoch_windows) <= whole:
            self.locate(sum(self.epoch_windows))  # lays out the next epoch
        return sum(self.epoch_windows[:whole]) + round((epochs - whole) * self.epoch_windows[whole])

    def epochs_at(self, windows: int) -> float:
        """Passes over the conversations that the first `windows` windows make."""
        epoch, within = self.locate(windows)
        return epoch + within / self.epoch_windows[epoch]

    def __getitem__(self, g: int):
        epoch, w = self.locate(g)
        order, starts = self.plan(epoch)
        tokens = np.full(self.window_len, self.pad_id, dtype=np.int64)
        trained = np.zeros(self.window_len, dtype=bool)
        filled = 0
        for doc in order[starts[w] : starts[w + 1]]:
            ids, mask = self.store.document(doc, int(self.lengths[doc]))
            tokens[filled : filled + len(ids)], trained[filled : filled + len(ids)] = ids, mask
            filled += len(ids)
        inputs, labels = split_window(torch.from_numpy(tokens))
        return inputs, labels.masked_fill(~torch.from_numpy(trained[1:]), IGNORED)
