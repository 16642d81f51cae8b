"""The shipped "sample" corpus: Python's own help topics, so no text has to live in the repo.

`pydoc_data.topics` ships with every CPython (about 80 documents, 465 KB of English prose and
code). The order is fixed (sorted topic names) so that a held-out split can be taken by index.
"""

from pydoc_data.topics import topics


def sample_documents() -> list[str]:
    """The corpus as a list of documents in a fixed order."""
    return [topics[name] for name in sorted(topics)]
