"""`opt(default, doc, ...)`: a config field with its type, default, range and one-line doc (its --help line)."""

from dataclasses import field
from typing import Any


def opt(
    default: Any,
    doc: str,
    *,
    choices: tuple = (),
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    sentinels: tuple = (),
    length: int | None = None,
) -> Any:
    """Declare a field. Numeric ranges (applied to each item of a list field): at_least/at_most
    are inclusive bounds, above/below exclusive; `sentinels` are values allowed outside the range
    (e.g. -1 = "all"); `length` is the required length of a list field."""
    meta = {
        "doc": doc,
        "choices": choices,
        "at_least": at_least,
        "above": above,
        "at_most": at_most,
        "below": below,
        "sentinels": sentinels,
        "length": length,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
