"""Document sources: where the text of one data-parallel rank comes from, in a resumable order.

A source is bound to one data-parallel rank and splits that rank's documents further between
the DataLoader worker processes, so every (rank, worker) reads a disjoint part. Its
`documents(epoch, position)` yields `(text, position after this document)`; `position` None
means the start of the epoch. The position is what a checkpoint stores to resume right after
the last document read.
"""

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import get_worker_info


def seeded_rng(*keys: int) -> np.random.Generator:
    """A generator determined by the integer keys alone (same on every machine and run)."""
    return np.random.default_rng([key % 2**64 for key in keys])


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker's id, number of workers); (0, 1) in the main process."""
    worker = get_worker_info()
    return (worker.id, worker.num_workers) if worker else (0, 1)


class IndexedDocuments:
    """Documents with random access (sample corpus, local files), reshuffled every epoch.

    Epoch e reads the documents in the order of a permutation drawn from (seed, e); rank r takes
    every dp_world-th document of it starting at r, and worker w of that rank every
    num_workers-th of those starting at w. The position counts the documents already read.
    """

    def __init__(self, texts: Sequence[str], dp_rank: int, dp_world: int, seed: int):
        self.texts = texts
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed

    def documents(self, epoch: int, position: int | None) -> Iterator[tuple[str, int]]:
        worker, num_workers = worker_slot()
        order = seeded_rng(self.seed, epoch).permutation(len(self.texts))
        mine = order[self.dp_rank :: self.dp_world][worker::num_workers]
        start = position or 0
        for read, index in enumerate(mine[start:], start=start + 1):
            yield self.texts[int(index)], read


class StreamedDocuments:
    """A streamed Hugging Face dataset (c4), read in its own order without shuffling.

    Ranks get whole shard files where the shard count divides the world size, else every
    dp_world-th record (datasets.split_dataset_by_node); the `datasets` library itself splits
    a rank's shards between its workers. The position is the stream's own state_dict, so a
    resume skips straight to the right file and record instead of re-reading the stream.
    """

    def __init__(self, stream, text_field: str, dp_rank: int, dp_world: int):
        from datasets.distributed import (
            split_dataset_by_node,  # here: `datasets` is a second of start-up (local_files.py)
        )

        self.stream = split_dataset_by_node(stream, rank=dp_rank, world_size=dp_world)
        self.text_field = text_field

    def documents(self, epoch: int, position: dict | None) -> Iterator[tuple[str, dict]]:
        self.stream.set_epoch(epoch)
        self.stream.load_state_dict(position)  # None starts the epoch from its beginning
        for record in self.stream:
            yield record[self.text_field], self.stream.state_dict()
