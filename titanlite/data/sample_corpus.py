"""The shipped "sample" corpus: Python's own help topics, so no text has to live in the repo.

`pydoc_data.topics` ships with every CPython (about 80 documents, 465 KB of English prose and
code). The order is fixed (sorted topic names) so that a held-out split can be taken by index:
the "validation" split is the last HELD_OUT topics (from "typesfunctions" to "yield" on
CPython 3.11, about 11% of the tokens), the "train" split all the others. The two never share a
document. The shipped tokenizer was built from the whole corpus (scripts/build_tokenizer.py).
"""

from pydoc_data.topics import topics

HELD_OUT = 10
SPLITS = ("train", "validation")
SAMPLE_SPLITS = {"sample": "train", "sample_val": "validation"}  # dataset name -> split


def sample_documents() -> list[str]:
    """The whole corpus as a list of documents in a fixed order."""
    return [topics[name] for name in sorted(topics)]


def sample_split(split: str) -> list[str]:
    """The documents of one split: "train" (dataset sample) or "validation" (dataset sample_val)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    documents = sample_documents()
    return documents[:-HELD_OUT] if split == "train" else documents[-HELD_OUT:]
