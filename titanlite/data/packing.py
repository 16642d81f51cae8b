"""Resumable streams of training windows: (inputs, labels), each a LongTensor of seq_len tokens.

Both classes are torch IterableDatasets with state_dict()/load_state_dict(), which torchdata's
StatefulDataLoader saves and restores (in each worker process when num_workers > 0), so a
resumed run sees exactly the windows an uninterrupted one would have.
"""

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

from titanlite.data.documents import seeded_rng, worker_slot
from titanlite.errors import UserError

Window = tuple[torch.Tensor, torch.Tensor]


# A batch cut to its longest row is as wide as a multiple of this: the GPU's matmul and attention kernels work in
# tiles of 64 or 128, and few distinct widths (seq_len / 64 at most) keep compile's graphs and the allocator's blocks
# few.
PAD_MULTIPLE = 64


def padded_width(longest: int, seq_len: int) -> int:
    """The width of a batch whose longest row holds `longest` tokens: rounded up to PAD_MULTIPLE, at most seq_len."""
    return min(seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)


def split_window(tokens: torch.Tensor) -> Window:
    """seq_len + 1 tokens -> inputs (all but the last) and labels (all but the first)."""
    return tokens[:-1], tokens[1:]


class PackedTokens(IterableDataset):
    """Documents tokenized with bos and eos, concatenated and cut into windows of seq_len + 1.

    Windows do not overlap: the next one starts at the first token the previous one did not
    hold, so the pair (last token of a window -> first token of the next) is never trained on.
    Tokens left over when a document ends wait in the buffer for the next document; documents
    are read and tokenized one at a time, never a whole corpus at once.
    With `infinite` the source is read again with the epoch counter raised; without it the
    stream ends after one pass (dropping a last partial window) and the next pass starts over.
    """

    def __init__(self, source, tokenizer, seq_len: int, infinite: bool):
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self.load_state_dict({"epoch": 0, "position": None, "buffer": []})

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "buffer": self.buffer[self.taken :]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.buffer = list(state["buffer"])
        # Tokens at the front of the buffer already cut into windows: dropped once per document,
        # not per window, since re-slicing the rest for every window is quadratic in a long document.
        self.taken = 0

    def __iter__(self) -> Iterator[Window]:
        window = self.seq_len + 1
        while True:
            read_any = self.position is not None
            for text, position in self.source.documents(self.epoch, self.position):
                read_any = True
                self.position = position
                self.buffer += self.tokenizer.encode(text, bos=True, eos=True)
                while len(self.buffer) - self.taken >= window:
                    tokens = self.buffer[self.taken : self.taken + window]
                    self.taken += window
                    yield split_window(torch.tensor(tokens, dtype=torch.long))
                del self.buffer[: self.taken]
                self.taken = 0
            if not read_any:  # would otherwise loop forever over empty epochs
                raise UserError(
                    "a data-loading worker got no documents at all; use fewer training.num_workers "
                    "or data-parallel ranks, or a dataset with more documents or shard files"
                )
            if not self.infinite:
                self.load_state_dict({"epoch": 0, "position": None, "buffer": []})
                return
            self.epoch, self.position = self.epoch + 1, None


class SyntheticTokens(IterableDataset):
    """Endless uniform random tokens for benchmarks: no files and no tokenizer work.

    The stream is global: window g is drawn from (seed, g) alone, and rank r of dp_world reads
    windows r, r + dp_world, ... So a global batch holds the same windows whatever the number of
    ranks, which lets a 1-process run and an N-rank FSDP run be compared step for step.
    Worker w of num_workers takes every num_workers-th of the rank's windows; its state is how
    many it has yielded.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, dp_rank: int, dp_world: int):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.yielded = 0

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = state["yielded"]

    def __iter__(self) -> Iterator[Window]:
        worker, num_workers = worker_slot()
        for count in itertools.count(self.yielded):
            rank_window = worker + count * num_workers
            rng = seeded_rng(self.seed, rank_window * self.dp_world + self.dp_rank)
            tokens = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1))
            self.yielded = count + 1
            yield split_window(tokens)
