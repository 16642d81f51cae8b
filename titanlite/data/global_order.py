"""One global order of training windows, the same at any scale (token stores and mixes).

Window g of the global stream is a function of (seed, g) alone. Epoch e lays the documents out
in the order of a permutation drawn from (seed, e), back to back, and the epochs follow one
another; window g is tokens [g * (seq_len + 1), (g + 1) * (seq_len + 1)) of that stream, cut as
packing.py cuts raw documents (no overlap; a document's rest flows into the next window, across
an epoch's end too).

Micro-batch k of the run (counted over all micro-steps) holds windows [k*D*b, (k+1)*D*b), and
data-parallel rank r of D takes the b windows from k*D*b + r*b. An optimizer step of A micro-steps
therefore reads windows [s*G, (s+1)*G) with G = A*D*b, the global batch: the same set for any
split of G into ranks, local batch and accumulation. The loader's state is one number, the
windows consumed over all ranks, which a run of any layout with the same global batch resumes
from; DataLoader workers only fetch the batches the sampler names, so they change nothing.
"""

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from titanlite.data.documents import seeded_rng
from titanlite.data.packing import split_window
from titanlite.data.store import TokenStore
from titanlite.errors import UserError
from titanlite.log import logger

MIX_BLOCK = 1000  # a mix's weights are kept exactly in every block of this many windows


class StoreWindows(Dataset):
    """Window g of a token store as (inputs, labels) LongTensors."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int):
        self.store, self.window_len, self.seed = store, seq_len + 1, seed
        self.total = store.total_tokens
        self.layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def windows_per_epoch(self) -> int:
        return self.total // self.window_len

    def windows_in(self, epochs: float) -> int:
        """The whole windows in the first `epochs` passes (the stream runs on across epochs)."""
        return int(epochs * self.total) // self.window_len

    def epochs_at(self, windows: int) -> float:
        """Passes over the data that the first `windows` windows make."""
        return windows * self.window_len / self.total

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in this epoch's order, the stream offset where each ends); the last two are kept."""
        if epoch not in self.layouts:
            order = seeded_rng(self.seed, epoch).permutation(len(self.store.doc_len))
            self.layouts = {e: v for e, v in self.layouts.items() if e == epoch - 1}
            self.layouts[epoch] = order, np.cumsum(self.store.doc_len[order])
        return self.layouts[epoch]

    def tokens(self, g: int) -> np.ndarray:
        store, out, filled = self.store, np.empty(self.window_len, dtype=np.int64), 0
        while filled < self.window_len:
            epoch, offset = divmod(g * self.window_len + filled, self.total)
            order, ends = self.epoch_layout(epoch)
            j = int(np.searchsorted(ends, offset, side="right"))
            while filled < self.window_len and j < len(order):
                doc = order[j]
                within = offset - (ends[j] - store.doc_len[doc])
                take = int(min(self.window_len - filled, store.doc_len[doc] - within))
                begin = store.doc_start[doc] + within
                out[filled : filled + take] = store.tokens(store.doc_shard[doc], begin, begin + take)
                filled, offset, j = filled + take, offset + take, j + 1
        return out

    def __getitem__(self, g: int):
        return split_window(torch.from_numpy(self.tokens(g)))


def block_counts(weights: list[float]) -> np.ndarray:
    """Windows of each source in a block of MIX_BLOCK: the weights' shares, rounded by largest remainder."""
    exact = np.asarray(weights) / sum(weights) * MIX_BLOCK
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: MIX_BLOCK - counts.sum()]] += 1
    return counts


class MixedWindows(Dataset):
    """A weighted interleave of sources: block n of MIX_BLOCK windows holds block_counts of each source,
    at places drawn from (seed, n); a source's k-th window in the mix is its own window k."""

    def __init__(self, sources: list[StoreWindows], weights: list[float], seed: int):
        self.sources, self.seed = sources, seed
        self.counts = block_counts(weights)
        self.blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def block(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each place in block n, its window index within that source's stream)."""
        if n not in self.blocks:
            owner = seeded_rng(self.seed, n, 1).permutation(np.repeat(np.arange(len(self.counts)), self.counts))
            rank_in_source = np.empty(MIX_BLOCK, dtype=np.int64)
            for source, count in enumerate(self.counts):
                rank_in_source[owner == source] = n * count + np.arange(count)
            self.blocks = {n: (owner, rank_in_source)}
        return self.blocks[n]

    def windows_seen(self, consumed: int) -> np.ndarray:
        """Windows each source contributed to the first `consumed` windows of the mix."""
        full, part = divmod(consumed, MIX_BLOCK)
        return full * self.counts + np.bincount(self.block(full)[0][:part], minlength=len(self.counts))

    def __getitem__(self, g: int):
        owner, index = self.block(g // MIX_BLOCK)
        return self.sources[owner[g % MIX_BLOCK]][int(index[g % MIX_BLOCK])]


class RankBatches:
    """The global window indices of one rank's batches, from micro-batch `start` on (a batch sampler)."""

    def __init__(self, start: int, batch_size: int, dp_rank: int, dp_world: int, limit: int | None):
        self.start, self.batch_size, self.dp_rank, self.dp_world, self.limit = (
            start,
            batch_size,
            dp_rank,
            dp_world,
            limit,
        )

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            first = (k * self.dp_world + self.dp_rank) * self.batch_size
            if self.limit is not None and first + self.batch_size > self.limit:
                return
            yield list(range(first, first + self.batch_size))
            k += 1


class GlobalOrderLoader:
    """Batches of one rank from a global window stream (StoreWindows, MixedWindows, or conversation_windows.py's
    ConversationWindows: a Dataset with windows_per_epoch()); its state is the windows consumed by all ranks.

    `identity` says which stream it is (sources, weights, seed, seq_len): a state of another stream is
    refused. `finite`: one pass over the first epoch's whole windows; every new iter() starts it again.
    """

    state_is_global = True

    def __init__(
        self,
        windows: Dataset,
        *,
        batch_size: int,
        dp_rank: int,
        dp_world: int,
        identity: dict,
        source_names: list[str],
        seq_len: int,
        num_workers: int = 0,
        finite: bool = False,
    ):
        self.windows, self.batch_size, self.dp_rank, self.dp_world = windows, batch_size, dp_rank, dp_world
        self.num_workers, self.identity, self.source_names, self.seq_len = num_workers, identity, source_names, seq_len
        self.limit = windows.windows_per_epoch() if finite else None
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"identity": self.identity, "windows_consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if state["identity"] != self.identity:
            raise UserError(
                f"the checkpoint's data position belongs to {state['identity']} but this run reads {self.identity}; "
                "resume with the same training.dataset_path or training.dataset_mix, job.seed, training.seq_len and "
                "training.packing"
            )
        per_micro_batch = self.batch_size * self.dp_world
        if state["windows_consumed"] % per_micro_batch:
            raise UserError(
                f"the checkpoint consumed {state['windows_consumed']} windows, not a multiple of "
                "training.local_batch_size "
                f"{self.batch_size} x data-parallel degree {self.dp_world}; resume with the same "
                "training.global_batch_size "
                "and a local batch x degree that divides it"
            )
        self.consumed = state["windows_consumed"]

    def tokens_by_source(self) -> dict[str, int]:
        """Label tokens each source has given all ranks so far (one source: all of them)."""
        if isinstance(self.windows, MixedWindows):
            counts = self.windows.windows_seen(self.consumed)
        else:
            counts = [self.consumed]
        return {name: int(count) * self.seq_len for name, count in zip(self.source_names, counts)}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        per_micro_batch = self.batch_size * self.dp_world
        sampler = RankBatches(
            self.consumed // per_micro_batch, self.batch_size, self.dp_rank, self.dp_world, self.limit
        )
        # Its own generator: iter() then draws nothing from the training's RNG, which a resume restores exactly.
        for batch in DataLoader(
            self.windows, batch_sampler=sampler, num_workers=self.num_workers, generator=torch.Generator()
        ):
            self.consumed += per_micro_batch
            yield batch
        self.consumed = 0  # a finite pass ended: the next starts over


def steps_for_epochs(epochs: float, loader, accum_steps: int, steps: int) -> int:
    """training.epochs as optimizer steps, rounded up (the last one may reach into the next epoch): the windows of
    that many passes over a store, chat data or preference pairs (a pair is a window), divided by the global batch's."""
    windows = getattr(loader, "windows", None)
    if not hasattr(windows, "windows_in"):
        raise UserError(
            f"training.epochs {epochs:g} counts passes over data whose epoch length is known at start, a token "
            "store (python -m titanlite.data.prepare), chat data or preference pairs, which this run's data is "
            "not; set training.steps instead"
        )
    per_step = loader.batch_size * loader.dp_world * accum_steps
    total = windows.windows_in(epochs)
    epoch_steps = max(1, -(-total // per_step))
    logger.info(
        f"training.epochs {epochs:g}: {total:,} {getattr(windows, 'unit', 'windows')} at {per_step} per step, "
        f"{epoch_steps:,} steps (in place of training.steps {steps})"
    )
    return epoch_steps


def epochs_done(loader) -> float | None:
    """Passes over the data that a loader's batches so far make, where its data has epochs: a token store, chat data
    or preference pairs (a mix, and the streams each rank packs for itself, have none)."""
    windows = getattr(loader, "windows", None)
    return windows.epochs_at(loader.consumed) if hasattr(windows, "epochs_at") else None
