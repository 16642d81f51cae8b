"""Train the small byte-level BPE shipped as assets/tokenizer.model, on the sample corpus.

    python scripts/build_tokenizer.py [--ranks 2000] [--out assets/tokenizer.model]

The ranks start with the 256 single bytes; each further rank is the most frequent adjacent pair
of tokens (ties: the smallest bytes), merged in the way tiktoken applies ranks: within a piece,
repeatedly merge the adjacent pair whose joined bytes have the lowest rank, leftmost first. Every
piece's segmentation is kept equal to what tiktoken would produce with the ranks so far, so the
written file encodes exactly as the trainer did; the script checks that on the whole corpus.
"""

import argparse
import base64
import heapq
import sys
import time
from collections import Counter
from pathlib import Path

import regex

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from titanlite.data.sample_corpus import sample_documents  # noqa: E402
from titanlite.data.tokenizer import PRETOKENIZE_PATTERN, SHIPPED_TOKENIZER, Tokenizer  # noqa: E402


def tiktoken_merge(parts: list[bytes], ranks: dict[bytes, int]) -> list[bytes]:
    """Continue tiktoken's BPE on `parts`: merge the lowest-ranked adjacent pair until none is ranked."""
    while len(parts) > 1:
        best_rank, best_at = None, -1
        for at in range(len(parts) - 1):
            rank = ranks.get(parts[at] + parts[at + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, at
        if best_rank is None:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def adjacent_pairs(parts: list[bytes]) -> list[bytes]:
    """Each adjacent pair, keyed by its joined bytes (how tiktoken looks ranks up)."""
    return [parts[at] + parts[at + 1] for at in range(len(parts) - 1)]


def train_bpe(pieces: Counter, num_ranks: int) -> tuple[dict[bytes, int], dict[bytes, list[bytes]]]:
    """Ranks (bytes -> rank) and each piece's final segmentation, from piece frequencies."""
    ranks = {bytes([byte]): byte for byte in range(256)}
    segmentation = {piece: [bytes([byte]) for byte in piece] for piece in pieces}
    pair_counts: Counter = Counter()
    pieces_with_pair: dict[bytes, set[bytes]] = {}
    for piece, parts in segmentation.items():
        for pair in adjacent_pairs(parts):
            pair_counts[pair] += pieces[piece]
            pieces_with_pair.setdefault(pair, set()).add(piece)
    # A max-heap of (count, pair) with stale entries skipped on pop: counts only change for the
    # pieces a merge touches, so re-pushing those is far cheaper than a full scan per merge.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    while len(ranks) < num_ranks and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts[pair] != -negative_count or negative_count == 0:
            continue
        ranks[pair] = len(ranks)
        # Only pieces holding this pair change; tiktoken would keep merging them from here.
        # The visiting order does not matter: counts add up and heap entries are totally ordered.
        for piece in pieces_with_pair.pop(pair):
            old = segmentation[piece]
            new = tiktoken_merge(list(old), ranks)
            if new == old:
                continue
            segmentation[piece] = new
            new_pairs = adjacent_pairs(new)
            changed = Counter(new_pairs)
            changed.subtract(adjacent_pairs(old))
            for changed_pair, delta in changed.items():
                if delta:
                    pair_counts[changed_pair] += delta * pieces[piece]
                    heapq.heappush(heap, (-pair_counts[changed_pair], changed_pair))
            for new_pair in new_pairs:
                pieces_with_pair.setdefault(new_pair, set()).add(piece)
    return ranks, segmentation


def write_tiktoken_file(ranks: dict[bytes, int], path: Path) -> None:
    lines = [
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2000, help="ranks in the file: 256 single bytes + merges")
    parser.add_argument("--out", type=Path, default=SHIPPED_TOKENIZER, help="tiktoken BPE file to write")
    args = parser.parse_args()

    started = time.perf_counter()
    documents = sample_documents()
    pattern = regex.compile(PRETOKENIZE_PATTERN)
    split_documents = [[piece.encode() for piece in pattern.findall(doc)] for doc in documents]
    ranks, segmentation = train_bpe(Counter(piece for doc in split_documents for piece in doc), args.ranks)
    write_tiktoken_file(ranks, args.out)

    tokenizer = Tokenizer(args.out)
    corpus_tokens = 0
    for doc, pieces in zip(documents, split_documents):
        trained = [ranks[part] for piece in pieces for part in segmentation[piece]]
        if tokenizer.encode(doc, bos=False, eos=False) != trained:
            sys.exit("tiktoken encodes the corpus differently from the trainer: the ranks are inconsistent")
        corpus_tokens += len(trained)
    corpus_bytes = sum(len(doc.encode()) for doc in documents)
    print(
        f"wrote {args.out}: {len(ranks)} ranks + specials = vocab {tokenizer.vocab_size}; "
        f"{corpus_bytes / corpus_tokens:.2f} bytes per token on the sample corpus "
        f"({corpus_tokens} tokens); {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
