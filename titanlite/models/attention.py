"""Which earlier tokens each token attends to, and the one attention call every family makes.

A packed window holds the end of one document and the start of others (see data/packing.py:
every document is tokenized as bos + text + eos and the documents are concatenated). Under
`model.attention_mask` block_causal a token attends only to earlier tokens of its own document,
as Llama 3 was trained; under causal it attends to every earlier token of the window.

The train step hands the model's forward the document ids of each window: conversations carry
theirs from the data (each conversation's start is known when its window is built, whatever the
template writes), text's are computed from the input tokens (`document_ids`). The model builds the
mask once per forward (`attention_mask`) and every block's attention reads that same mask through
`attend`. One mask rule (`allowed`) is evaluated two ways:
  - CUDA: a FlexAttention BlockMask and compiled `flex_attention`, which skips the masked-out
    blocks of the score matrix.
  - elsewhere: a boolean [batch, 1, T, T] mask for scaled_dot_product_attention. FlexAttention has
    no backward on CPU (torch 2.13 raises NotImplementedError), and its compiled forward alone cost
    16 s for the first shape and 7 s for each new one here, against milliseconds for the step.
Without documents the mask is what it was before document masks existed, on every device: None
(SDPA's is_causal path), or Mistral's [T, T] window where the window is shorter than the sequence.

Under context parallelism (parallel/cp.py) a rank holds only some positions of each window (a
SequenceShard): its queries are those positions, its keys and values are gathered from the whole
cp group inside `attend`, and the same rule is evaluated at each query's and key's true position.
"""

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titanlite.log import logger
from titanlite.models.kv_cache import CacheStep, LayerStep
from titanlite.parallel.cp import SequenceShard


@dataclass(frozen=True, eq=False)
class GatheredKeys:
    """A context-parallel attention's mask: over this rank's queries and the gathered keys ([B or 1, 1,
    T_local, T], or a BlockMask on CUDA), with the gather `attend` applies to keys and values first."""

    mask: torch.Tensor | BlockMask
    gather: Callable[[torch.Tensor], torch.Tensor]


# int: Mistral's window alone (window_mask); CacheStep: generation's cache (models/kv_cache.py), which each block
# receives as its own LayerStep (for_layer)
Mask = torch.Tensor | BlockMask | GatheredKeys | CacheStep | LayerStep | int | None


def for_layer(mask: Mask, name: str) -> Mask:
    """What block `name` (its key in model.layers) attends under: its own cache under generation's cache step, else
    the mask every block shares."""
    return mask.layer(name) if isinstance(mask, CacheStep) else mask


def document_delimiters(attention_mask: str, tokenizer, dataset: str) -> tuple[int, int] | None:
    """(bos, eos) of the tokenizer when windows are to be split into documents (block_causal), else None.
    Synthetic tokens are uniform random ids, not documents: a bos among them is noise, so their
    windows are attended causally (the kernel a benchmark on them should time, as on real text
    with causal), and the run says so."""
    if attention_mask != "block_causal":
        return None
    if dataset == "synthetic":
        logger.info(
            "training.dataset synthetic holds no documents: attention is causal over each window "
            "(model.attention_mask block_causal applies to real text)"
        )
        return None
    return tokenizer.bos_id, tokenizer.eos_id


def document_ids(tokens: torch.Tensor, delimiters: tuple[int, int] | None) -> torch.Tensor | None:
    """tokens [B, T] -> int32 [B, T]: 0 for the window's first document, then one more at each
    document's first token, its bos. `delimiters` is (bos, eos) from document_delimiters; None (causal
    attention) gives None: no documents.

    A tokenizer whose bos is its eos (GPT-2's <|endoftext|>) puts two delimiters between documents
    (eos of one, bos of the next), so there the second of two delimiters in a row starts a document.
    """
    if delimiters is None:
        return None
    bos_id, eos_id = delimiters
    starts = tokens == bos_id
    if bos_id == eos_id:
        starts = torch.cat([starts[:, :1], starts[:, 1:] & starts[:, :-1]], dim=1)
    ids = starts.int().cumsum(dim=1, dtype=torch.int32)
    return ids - ids[:, :1]  # the window may start mid-document or on a bos: 0 either way


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions that restart at 0 at each document's first token (model.reset_position_ids)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first_of_document = torch.where(starts, index, 0).cummax(dim=1).values
    return index - first_of_document


def allowed(document_ids: torch.Tensor | None, window: int | None) -> Callable:
    """The mask rule, as FlexAttention's mask_mod(b, h, q, kv) -> bool: a key at or before the
    query, at most `window` - 1 tokens back (Mistral; None = no limit), in the query's document."""

    def rule(b, h, q, kv):
        keep = q >= kv
        if window is not None:
            keep = keep & (q - kv < window)
        if document_ids is not None:
            keep = keep & (document_ids[b, q] == document_ids[b, kv])
        return keep

    return rule


def attention_mask(
    document_ids: torch.Tensor | None, window: int | None, device: torch.device, shard: SequenceShard | None = None
) -> Mask:
    """The mask every block of one forward shares; None = plain causal. Without documents, Mistral's
    window stays an int that `attend` turns into its [T, T] mask: only there is the whole sequence
    length known (a later pipeline stage under sequence parallelism receives a shard of it).
    Under context parallelism (`shard`) it is always a mask (the queries are not the keys' first T_local)."""
    if document_ids is None and shard is None:
        return window
    seq_len = shard.seq_len if shard is not None else document_ids.shape[1]
    if window is not None and window >= seq_len:
        window = None  # cuts nothing off
    rule = allowed(document_ids, window)
    if shard is None:
        queries = keys = torch.arange(seq_len, device=device)
    else:
        queries, keys = shard.positions, shard.key_positions
    batch = None if document_ids is None else document_ids.shape[0]
    if device.type == "cuda":

        def at_positions(b, h, q, kv):
            return rule(b, h, queries[q], keys[kv])

        # Without CP the indices are the positions: the rule as it is, no lookup in the compiled mask builder.
        mask_mod = rule if shard is None else at_positions
        mask = compiled(create_block_mask)(mask_mod, batch, None, len(queries), len(keys), device=device)
    else:
        rows = torch.arange(batch or 1, device=device)[:, None, None, None]
        mask = rule(rows, 0, queries[:, None], keys[None, :])  # [B, 1, T_local, T] or [T_local, T]
    return mask if shard is None else GatheredKeys(mask, shard.gather)


def window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Mistral's window alone: [T, T], the same for every sequence; None where it cuts nothing off
    (which keeps the unmasked flash kernels)."""
    if window >= seq_len:
        return None
    positions = torch.arange(seq_len, device=device)
    return allowed(None, window)(0, 0, positions[:, None], positions[None, :])


@functools.cache
def compiled(function: Callable) -> Callable:
    """FlexAttention's functions compiled once per process, on first use. Uncompiled, flex_attention
    computes the whole score matrix and create_block_mask materialises a [B, 1, T, T] mask; the
    compiled mask builder traces once and takes each batch's document ids as an input, without
    recompiling. Compiling at import would load dynamo (2.7 s here) into every process."""
    return torch.compile(function)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float | None = None) -> torch.Tensor:
    """Attention of q [B, heads, T, qk_dim], k [B, kv_heads, T, qk_dim] and v [B, kv_heads, T, v_dim] under
    `mask`; query head h reads key/value head h // (heads / kv_heads) (grouped-query attention). The scores
    are scaled by `scale`, 1 / sqrt(qk_dim) when None (DeepSeek's YaRN changes it)."""
    if isinstance(mask, GatheredKeys):  # context parallelism: only the key/value heads travel
        k, v, mask = mask.gather(k), mask.gather(v), mask.mask
    elif isinstance(mask, LayerStep):  # generation: the earlier tokens' keys and values come first
        (k, v), mask = mask.extend(k, v), mask.mask
        if k.shape[1] < q.shape[1]:
            return grouped_attention(q, k, v, mask, scale)
    if k.shape[1] < q.shape[1]:
        # An explicit repeat works on every SDPA backend, unlike enable_gqa, which some kernels do not support.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if isinstance(mask, int):
        mask = window_mask(q.shape[2], mask, q.device)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if isinstance(mask, BlockMask):  # inside a compiled block dynamo traces flex_attention itself
        attention = flex_attention if torch.compiler.is_compiling() else compiled(flex_attention)
        return attention(q, k, v, block_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Grouped-query attention without repeating the keys and values (generation reads the whole cache every step):
    the query heads that share a key/value head become one longer sequence of queries, the mask [B, 1, T, S]
    repeated for each; q [B, heads, T, d] -> [B, heads, T, v_dim]."""
    batch, heads, length, dim = q.shape
    groups = heads // k.shape[1]
    mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * length, mask.shape[-1])
    out = F.scaled_dot_product_attention(
        q.reshape(batch, k.shape[1], groups * length, dim), k, v, attn_mask=mask, scale=scale
    )
    return out.view(batch, heads, length, v.shape[-1])
