"""Weight initialisation that gives the same values whatever the sharding.

Each parameter is filled in fixed blocks of rows, every block from its own generator seeded by
(seed, parameter name, block index). A rank fills only the blocks its shard overlaps, so a model
initialised on 1 process equals, element for element, the same model initialised under FSDP on
N processes — and no rank ever materialises more than one block of a tensor it does not own.
"""

import zlib

import torch
from torch.distributed.tensor import DTensor

# Blocks of about this many elements: big enough to be fast, small enough to stay cheap for
# ranks that need only a sliver of a block.
_BLOCK_ELEMENTS = 1 << 20


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: DTensor shards are all-gathered (every rank must call this in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_view(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank writes into and its offset in the full (global) tensor."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(offset)
    return param, (0,) * param.dim()


def _block_seed(seed: int, key: str, block: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) * 65_537 + block


@torch.no_grad()
def trunc_normal_(param: torch.Tensor, std: float, key: str, seed: int = 0) -> None:
    """Fill `param` with N(0, std) truncated at ±3·std, identically for any sharding.

    `key` names the parameter (its FQN is the natural choice) so every tensor draws
    its own stream; `seed` is the job seed.
    """
    local, offset = local_view(param)
    if local.numel() == 0:
        return
    full_shape = tuple(param.shape) if param.dim() else (1,)
    local = local.view(local.shape if param.dim() else (1,))
    offset = offset if param.dim() else (0,)
    row_shape = full_shape[1:]
    row_numel = max(1, int(torch.Size(row_shape).numel()))
    rows_per_block = max(1, _BLOCK_ELEMENTS // row_numel)
    first_row, last_row = offset[0], offset[0] + local.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
    generator = torch.Generator(device=local.device)
    for block in range(first_row // rows_per_block, (last_row - 1) // rows_per_block + 1):
        start = block * rows_per_block
        stop = min(start + rows_per_block, full_shape[0])
        values = torch.empty((stop - start, *row_shape), device=local.device, dtype=torch.float32)
        generator.manual_seed(_block_seed(seed, key, block))
        torch.nn.init.trunc_normal_(values, std=std, a=-3 * std, b=3 * std, generator=generator)
        lo, hi = max(start, first_row), min(stop, last_row)
        local[lo - first_row : hi - first_row].copy_(values[(slice(lo - start, hi - start), *inner)])
