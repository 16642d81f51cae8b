"""The key/value cache generation runs the decoders with: each block's keys and values of the tokens
already seen, so a new token costs one position's work instead of the whole sequence's.

The cache is static, as gpt-fast's: every layer's buffers are allocated once, at the prefill, with room for
`capacity` columns, and each decode step writes its token into its slot in place (no torch.cat, no new shapes),
so the decode step can be compiled once and replayed. Under a sliding window (Mistral) the capacity is at most the
window and the slots are a ring: column c goes to slot c % capacity, overwriting a column the window no longer
reaches.

A batch holds prompts of different lengths left-padded, as transformers batches them: every row's next token sits
in the same column, so one forward feeds all rows. Each row counts its positions from its first real token (RoPE,
GPT-2's table), and each slot remembers its position in its row (-1 = padding or empty): the mask is computed from
those positions, so no query attends to padding, to an empty slot or beyond the window. A padded query of the
prefill attends to itself only (its output is never read): a row of nothing but masked keys would give NaN, and a
NaN in a padded value would reach real queries through 0 * NaN.

Two kinds of forward use it: the prefill (`prefill`: the prompts [B, T] on an empty cache, attending among
themselves, their last `capacity` columns stored) and the decode step (`decode`: one token per row, attending to
every slot). Training never passes a cache; with one, the model's forward takes a `CacheStep` (the positions and
mask every layer shares) and hands each block its own layer's view of it, `step.layer(name)` (a `LayerStep`: that
layer's buffers, as gpt-fast hands each attention its own cache), in place of the mask (models/attention.py's
`for_layer`; `attend` and DeepSeek's latent attention recognise it), so the blocks and their signatures are the
training ones, and no layer is found by counting calls.

Each layer keeps tensors whose sequence dimension is -2: keys and values [B, kv_heads, S, head_dim], or DeepSeek's
normalised latent [B, S, kv_lora_rank] and its shared RoPE key [B, S, rope_dim], which is what DeepSeek's
inference caches.
"""

import torch


class KVCache:
    def __init__(self, batch: int, capacity: int, window: int | None, device: torch.device):
        """Room for `capacity` columns (the prompts' width plus the new tokens); window: the model's sliding window
        (args.sliding_window), None = every position stays reachable."""
        self.capacity = min(capacity, window) if window is not None else capacity
        self.window = window
        self.layers: dict[str, tuple[torch.Tensor, ...]] = {}  # each layer's buffers, by its name in model.layers
        self.key_positions = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)
        self.next_positions = torch.zeros(batch, dtype=torch.long, device=device)  # each row's next token's position
        self.column = torch.zeros((), dtype=torch.long, device=device)  # the next token's column (same in every row)

    def allowed(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """[B, T, S] True where a query at query_positions [B, T] may read a key at key_positions [B, S]."""
        keys, queries = key_positions[:, None, :], query_positions[:, :, None]
        allowed = (keys >= 0) & (keys <= queries)
        if self.window is not None:
            allowed &= queries - keys < self.window
        return allowed

    def prefill(self, valid: torch.Tensor) -> "CacheStep":
        """The step for the prompts [B, T] on the empty cache, `valid` [B, T] False at left padding: their positions
        and the mask of their queries over themselves."""
        width = valid.shape[1]
        positions = valid.long().cumsum(dim=1) - 1
        keys = torch.where(valid, positions, -1)
        allowed = self.allowed(keys, positions)
        allowed |= torch.eye(width, dtype=torch.bool, device=valid.device) & ~valid[:, :, None]
        kept = torch.arange(max(0, width - self.capacity), width, device=valid.device)
        self.key_positions[:, kept % self.capacity] = keys[:, kept]
        self.next_positions.copy_(positions[:, -1] + 1)
        self.column.fill_(width)
        return CacheStep(self, positions.clamp(min=0), allowed[:, None], kept % self.capacity, kept)

    def decode(self) -> "CacheStep":
        """The step for one new token per row: its position, its slot written, the mask over every slot. Only
        tensor operations, in place: the step compiles to one graph."""
        positions = self.next_positions[:, None].clone()
        writes = (self.column % self.capacity)[None]
        self.key_positions.index_copy_(1, writes, positions)
        self.next_positions += 1
        self.column += 1
        return CacheStep(self, positions, self.allowed(self.key_positions, positions)[:, None], writes)


class CacheStep:
    """One forward's view of the cache, shared by its layers: positions [B, T] of the new tokens (0 at padding), the
    mask [B, 1, T, S] (True = attend) over the keys the attention reads, the slots the new columns go to and, at the
    prefill, which of its columns are kept (the last `capacity`; None at a decode step, whose one column is)."""

    def __init__(
        self,
        cache: KVCache,
        positions: torch.Tensor,
        mask: torch.Tensor,
        writes: torch.Tensor,
        kept: torch.Tensor | None = None,
    ):
        self.cache, self.positions, self.mask, self.writes, self.kept = cache, positions, mask, writes, kept

    def layer(self, name: str) -> "LayerStep":
        """The view of block `name` (its key in model.layers): its own buffers, allocated at the prefill."""
        return LayerStep(self, name)


class LayerStep:
    """One block's cache in one forward: what its attention reads as its mask."""

    def __init__(self, step: CacheStep, name: str):
        self.step, self.name, self.mask = step, name, step.mask

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This block's keys and values to attend to (sequence dimension -2), `new` stored: at the prefill the new ones
        alone (the cache held nothing), at a decode step every slot."""
        step, layers = self.step, self.step.cache.layers
        prefill = step.kept is not None
        if self.name not in layers:  # the prefill allocates the layer's buffers
            layers[self.name] = tuple(t.new_zeros(*t.shape[:-2], step.cache.capacity, t.shape[-1]) for t in new)
        for buffer, t in zip(layers[self.name], new):
            buffer.index_copy_(buffer.dim() - 2, step.writes, t.index_select(-2, step.kept) if prefill else t)
        return new if prefill else layers[self.name]
