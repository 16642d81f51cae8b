"""Chat data in one global order: whole conversations packed into windows, the same at any scale.

Epoch e lays the conversations out in the order of a permutation drawn from (seed, e), cuts it into
buffers of PACK_BUFFER conversations and packs each buffer whole into windows of seq_len + 1 tokens,
best-fit-decreasing (the longest first, each into the fullest window it still fits); the rest of a
window is eos padding outside the loss. Every window carries where its conversations start, as
document ids over its inputs (conversation k of the window is k, the padding tail one more): the
model attends within a conversation and restarts its positions at 0 there (models/attention.py's
document_positions), so nothing is inferred from the tokens and every template packs, ChatML's
too, which writes no bos. With packing off (training.packing false) each window holds one conversation.
One longer than a window is truncated to it (never split over two); one with no trained label in its
first window is left out. Window g of the stream is window g - (the windows of the earlier epochs) of
its epoch, so it depends on (seed, g) alone, and global_order.py's loader deals the windows to the
ranks exactly as it deals a token store's: any split of the global batch into ranks, local batch and
accumulation reads the same conversations.
"""

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.data.documents import seeded_rng
from titanlite.data.packing import split_window
from titanlite.data.store import TokenStore
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.loss import IGNORED

# Conversations packed together: enough that best fit finds a short one for nearly every gap (conversations of
# 50-150 tokens fill windows of 513 tokens 97% full), few enough that each placement's insertion into the sorted free
# room (a list of a buffer's windows) stays cheap however many conversations an epoch holds.
PACK_BUFFER = 1000


def trained_counts(store: TokenStore, lengths: np.ndarray) -> np.ndarray:
    """Trained tokens within the first lengths[d] tokens of each document d, one shard at a time."""
    counts = np.zeros(len(lengths), dtype=np.int64)
    for shard, mask in enumerate(store.masks):
        docs = np.flatnonzero(store.doc_shard == shard)
        running = np.concatenate([[0], np.cumsum(store.mask(shard, 0, len(mask)), dtype=np.int64)])
        starts = store.doc_start[docs]
        counts[docs] = running[starts + lengths[docs]] - running[starts]
    return counts


def best_fit(lengths: np.ndarray, window: int) -> list[list[int]]:
    """Best-fit-decreasing: the documents of these lengths (each at most `window`) as windows, lists of their
    indices. Longest first, each goes to the open window with the least room that still holds it, else opens one."""
    windows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, window), sorted: the first that holds a document fits it best
    for i in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[i])
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            windows.append([i])
            left, w = window - length, len(windows) - 1
        else:
            left, w = room.pop(at)
            windows[w].append(i)
            left -= length
        if left:
            bisect.insort(room, (left, w))
    return windows


def pack(order: np.ndarray, lengths: np.ndarray, window: int, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's order of documents (`lengths`: every document's, by index) cut into buffers of PACK_BUFFER, each
    packed best-fit-decreasing and its windows shuffled (seed, epoch, buffer) so that batches are not sorted by
    length: (the documents in window order, the index of each window's first document in it, then len(order))."""
    packed, starts = [], [0]
    for buffer, first in enumerate(range(0, len(order), PACK_BUFFER)):
        chunk = order[first : first + PACK_BUFFER]
        windows = best_fit(lengths[chunk], window)
        for w in seeded_rng(seed, epoch, buffer).permutation(len(windows)).tolist():
            packed.extend(chunk[windows[w]].tolist())
            starts.append(len(packed))
    return np.asarray(packed, dtype=np.int64), np.asarray(starts)


class ConversationWindows(Dataset):
    """Window g of a chat store (tokens with a loss mask) as (inputs, labels, {"document_ids"}): labels IGNORED where
    not trained, document_ids int32 [seq_len] saying which conversation each input belongs to (the position ids
    the model derives from them restart at each conversation's first token)."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, pad_id: int, key: str, packing: bool = True):
        self.store, self.window_len, self.seed, self.pad_id, self.packing = store, seq_len + 1, seed, pad_id, packing
        self.lengths = np.minimum(store.doc_len, self.window_len)
        counts = trained_counts(store, self.lengths)
        self.kept = np.flatnonzero(counts > 0)
        where, seq_key = f"{key} {store.name}", f"{key.split('.')[0]}.seq_len"  # training's or validation's
        if not len(self.kept):
            raise UserError(
                f"{where}: no conversation has a trained token within its first {seq_key} + 1 = "
                f"{self.window_len} tokens; raise {seq_key} or check training.train_on"
            )
        truncated = int((store.doc_len > self.window_len).sum())
        if truncated:
            logger.info(
                f"{where}: {truncated:,} of {len(store.doc_len):,} conversations are longer than {seq_key} + 1 = "
                f"{self.window_len} tokens and are truncated to one window"
            )
        if len(self.kept) < len(store.doc_len):
            logger.info(
                f"{where}: {len(store.doc_len) - len(self.kept):,} conversations hold no trained token within one "
                "window (truncated before any) and are left out"
            )
        self.epoch_windows: list[int] = []  # how many windows each epoch packs, as far as laid out
        self.plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        windows = self.windows_per_epoch()
        fill = self.lengths[self.kept].sum() / (windows * self.window_len)
        how = "packed best-fit" if packing else "one conversation per window (training.packing false)"
        logger.info(
            f"{where}: an epoch is {windows:,} windows of {self.window_len} tokens, {len(self.kept):,} conversations "
            f"with {int(counts[self.kept].sum()):,} trained tokens, {how}: the windows are {fill:.0%} full "
            "(the rest is padding)"
        )

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the conversations in this epoch's window order, the index of each window's first one in it, then the
        count); the last two epochs' are kept."""
        if epoch not in self.plans:
            order = self.kept[seeded_rng(self.seed, epoch).permutation(len(self.kept))]
            self.plans = {e: v for e, v in self.plans.items() if e == epoch - 1}
            self.plans[epoch] = (
                pack(order, self.lengths, self.window_len, self.seed, epoch)
                if self.packing
                else (order, np.arange(len(order) + 1))
            )
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
        documents = np.empty(self.window_len, dtype=np.int32)
        filled = 0
        for k, doc in enumerate(order[starts[w] : starts[w + 1]]):
            ids, mask = self.store.document(doc, int(self.lengths[doc]))
            tokens[filled : filled + len(ids)], trained[filled : filled + len(ids)] = ids, mask
            documents[filled : filled + len(ids)] = k
            trained[filled] = False  # a conversation's first token is no one's label: the one before ends another
            filled += len(ids)
        documents[filled:] = starts[w + 1] - starts[w]  # the padding tail, a document of its own
        inputs, labels = split_window(torch.from_numpy(tokens))
        return (
            inputs,
            labels.masked_fill(~torch.from_numpy(trained[1:]), IGNORED),
            {"document_ids": torch.from_numpy(documents[:-1])},
        )
