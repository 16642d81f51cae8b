"""Context parallelism: every window split over the cp ranks, each attention gathering keys and values.

Load balance. Under a causal mask a token attends to every earlier one, so a window's last tokens cost
the most. The window is cut into 2N chunks (N = cp ranks) and rank r holds chunks r and 2N-1-r: one
cheap and one dear chunk each, so every rank scores exactly the same number of (query, key) pairs
(chunks i and 2N-1-i together see 2N chunks' worth of earlier keys, whatever i; tests/test_cp.py).

Attention. Each rank all-gathers the keys and values of its cp group before attending (Llama 3's
approach for its 128k training), not a ring passing key/value blocks around:
  - any mask works unchanged: the gathered keys' true positions go into the same rule (documents,
    Mistral's window, causal), and one FlexAttention (CUDA) or SDPA (CPU) call does the rest;
  - under grouped-query attention only the key/value heads travel (attend repeats them after the
    gather): for Llama 3.1 8B at 131,072 tokens one layer's gathered keys and values are
    131,072 x 8 heads x 128 x 2 x 2 bytes = 512 MiB in bf16, freed with the layer's other activations;
  - the price: the gather is not overlapped with compute (a ring overlaps each block's transfer with
    the previous block's attention). The planner counts it as exposed time.
The gathered keys come in gather order (rank 0's chunks, then rank 1's, ...); attention does not care
about key order, so they are not reordered: the mask is evaluated at each key's true position.

Gradients. The gather's backward is a reduce-scatter: each rank receives the sum of every rank's
gradient for its keys and values. A rank's loss is the mean over its share of the window (all shares
are the same size), and FSDP averages gradients over (dp_shard, cp), so the result is the gradient of
the whole window's mean loss, as one process computes it.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# all_gather_single_autograd is torch 2.13's name; all_gather_tensor_autograd (torch 2.11) warns there.
_gather_dim0 = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """This rank's share of every window under context parallelism: the model
    sees only the tokens at `positions`, and each attention gathers every cp rank's keys and values."""

    positions: torch.Tensor  # [T_local] int64: the window positions of this rank's tokens, in order
    key_positions: torch.Tensor  # [T]: the window positions of the gathered keys, in the order `gather` returns them
    gather: Callable[[torch.Tensor], torch.Tensor]  # [B, heads, T_local, D] -> [B, heads, T, D], with its backward

    @property
    def seq_len(self) -> int:
        """The whole window's length."""
        return self.key_positions.shape[0]

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] over the whole window -> [B, T_local, ...] of this rank's positions."""
        return per_token[:, self.positions]


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The window positions cp rank `rank` holds: chunks rank and 2cp-1-rank of 2cp, in order."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * chunk])


def shard_of(
    seq_len: int, cp: int, rank: int, gather: Callable[[torch.Tensor], torch.Tensor], device=None
) -> SequenceShard:
    """cp rank `rank`'s SequenceShard of `seq_len`-token windows, whose keys and values come from `gather`."""
    every_rank = [chunk_positions(seq_len, cp, r, device) for r in range(cp)]
    return SequenceShard(every_rank[rank], torch.cat(every_rank), gather)


def sequence_shard(seq_len: int, cp_mesh: DeviceMesh, device) -> SequenceShard:
    """This rank's SequenceShard of `seq_len`-token windows over the cp ranks of `cp_mesh`."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        """[B, heads, T_local, D] -> [B, heads, T, D] of every cp rank, rank by rank; backward reduce-scatters."""
        return gather_ranks(x.movedim(2, 0), cp_mesh).movedim(0, 2)  # funcol gathers along dim 0 only

    return shard_of(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), gather, device)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous: the gathered keys and values are used
    with their sequence dim moved back (and a sum over ranks expands its gradient), and torch 2.11's gather
    reduce-scatters the gradient it is given, which must be contiguous ("Expected input.is_contiguous()")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def gather_ranks(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every cp rank's x concatenated along dim 0, rank by rank; the backward sums each rank's gradients
    (a reduce-scatter). Traceable by torch.compile, unlike torch.distributed's own collectives."""
    gathered = _ContiguousGradient.apply(_gather_dim0(x.contiguous(), 0, cp_mesh))
    if x.device.type == "cpu":
        # On gloo two functional collectives in flight at once (the keys' and the values' gathers) corrupt the
        # heap: torch 2.13 aborts with "malloc(): unaligned tcache chunk detected" within a few thousand
        # gathers (tests/cp_gather_stress.py). Copying waits for this gather before the next one starts;
        # NCCL has no such fault and keeps the gathers in flight together.
        gathered = gathered.clone()
    return gathered


def sum_over_ranks(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """The sum of x over the cp ranks, differentiable (every rank's gradient reaches every rank's x)."""
    return gather_ranks(x.unsqueeze(0), cp_mesh).sum(dim=0)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Tell every module that reduces over whole sequences (a MoE's per-sequence balance loss) which
    ranks hold the rest of each sequence."""
    for module in model.modules():
        if hasattr(module, "sequence_mesh"):
            module.sequence_mesh = cp_mesh


def split_batch(
    inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, shard: SequenceShard | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A batch of whole windows -> this rank's (inputs, labels, the model's keyword inputs). Under context
    parallelism the inputs and labels are this rank's positions, the document ids stay whole (the mask
    needs every key's document) and the model is told its shard; without it the batch is unchanged."""
    kwargs = {} if document_ids is None else {"document_ids": document_ids}
    if shard is None:
        return inputs, labels, kwargs
    return shard.take(inputs), shard.take(labels), kwargs | {"sequence_shard": shard}
