"""The key/value cache generation runs the decoders with: each block's keys and values of the tokens
already seen, so a new token costs one position's work instead of the whole sequence's.

A batch holds prompts of different lengths left-padded, as transformers batches them: every row's
next token sits in the same column, so one forward feeds all rows. Each row counts its positions from
its first real token (RoPE, GPT-2's table) and no query attends to padding. A padded query attends to
itself only (its output is never read): a row of nothing but masked keys would give NaN, and a NaN in
a padded value would reach real queries through 0 * NaN.

Training never passes a cache; with one, the model's forward hands a `CacheStep` down to the blocks
in place of the mask (`attend` and DeepSeek's latent attention recognise it), so the blocks and their
signatures are the training ones. The cache counts the attention calls of one forward: the n-th call is
block n, since every decoder runs its blocks in order.

Each layer keeps tensors whose sequence dimension is -2: keys and values [B, kv_heads, S, head_dim],
or DeepSeek's normalised latent [B, S, kv_lora_rank] and its shared RoPE key [B, S, rope_dim], which
is what DeepSeek's inference caches. Under a sliding window (Mistral) only the last window - 1 slots are
kept after each forward: a later query, window or more positions on, never reads the older ones.
"""

import torch


class KVCache:
    def __init__(self, window: int | None = None):
        """window: the model's sliding window (args.sliding_window), None = keep every position."""
        self.window = window
        self.layers: list[tuple[torch.Tensor, ...]] = []
        self.key_positions: torch.Tensor | None = None  # [B, S] each slot's position in its row, -1 = padding
        self.next_positions: torch.Tensor | None = None  # [B] the position of each row's next token
        self.next_layer = 0  # the block the next attention call of this forward belongs to

    def step(self, valid: torch.Tensor) -> "CacheStep":
        """The step for a forward of new tokens [B, T], `valid` [B, T] False at left padding: their
        positions and the mask of their queries over every cached slot and themselves."""
        batch, new = valid.shape
        start = self.next_positions if self.next_positions is not None else valid.new_zeros(batch, dtype=torch.long)
        positions = start[:, None] + valid.long().cumsum(dim=1) - 1
        self.next_positions = positions[:, -1] + 1
        new_keys = torch.where(valid, positions, -1)
        keys = new_keys if self.key_positions is None else torch.cat([self.key_positions, new_keys], dim=1)
        queries = positions[:, :, None]
        allowed = (keys[:, None, :] >= 0) & (keys[:, None, :] <= queries)
        if self.window is not None:
            allowed &= queries - keys[:, None, :] < self.window
        slots = torch.arange(keys.shape[1], device=valid.device)
        own_slot = slots[None, :] == slots[-new:, None]  # [T, S]: query i's own slot
        allowed |= own_slot & ~valid[:, :, None]
        self.key_positions = self.kept(keys, dim=-1)
        self.next_layer = 0
        return CacheStep(self, positions.clamp(min=0), allowed[:, None])

    def kept(self, full: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """What stays of a tensor whose sequence dimension is `dim` after a forward: all of it, or the
        last window - 1 slots."""
        if self.window is None:
            return full
        return full.narrow(dim, max(0, full.shape[dim] - (self.window - 1)), min(full.shape[dim], self.window - 1))

    def extend(self, layer: int, new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s cached tensors followed by `new` (sequence dimension -2), which the cache keeps."""
        if layer == len(self.layers):
            full = new
            self.layers.append(tuple(self.kept(t) for t in full))
        else:
            full = tuple(torch.cat([old, t], dim=-2) for old, t in zip(self.layers[layer], new))
            self.layers[layer] = tuple(self.kept(t) for t in full)
        return full


class CacheStep:
    """One forward's view of the cache: positions [B, T] of the new tokens (0 at padding) and the mask
    [B, 1, T, S] (True = attend) over the cached slots and the new ones. The count of blocks served lives
    in the cache: wrappers (FSDP's input casts) may hand each block a copy of the step."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor):
        self.cache, self.positions, self.mask = cache, positions, mask

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The calling block's cached tensors with `new` appended (each sequence dimension -2)."""
        full = self.cache.extend(self.cache.next_layer, new)
        self.cache.next_layer += 1
        return full
