"""Mistral: the Llama decoder (same blocks, same parameter names) with sliding-window attention."""

from titanlite.models.llama.model import Transformer


class Mistral(Transformer):
    """The window is args.sliding_window, which the decoder's forward puts into the attention mask
    it builds once for all blocks (models/attention.py), together with the document boundaries."""
