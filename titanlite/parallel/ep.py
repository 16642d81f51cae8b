"""Expert parallelism over the data-parallel ranks: each MoE block's routed experts are split evenly
over the ep ranks (Shard(0) of the stacked [experts * out, in] weights on the "ep" mesh dim), and
each rank sends every token-to-expert assignment of its own batch to the rank holding that expert,
with an all-to-all of variable splits, and gets the results back with a second one.

The MoE module is duck-typed (this package does not import the models): apply_ep distributes the
w1/w2/w3 of every module with `num_experts` and sets its `ep_group`; the MoE's run_experts then
dispatches through all_to_all below. The router and shared experts stay ordinary layers, FSDP-sharded
with their block over all data-parallel ranks; apply_fsdp shards the experts over the remaining ranks.

EP x TP: the experts are split over the ep x tp ranks, whole experts per rank (Shard(0) on the
flattened (ep, tp) mesh: rank (e, t) holds block e * tp + t), and the tokens move as under TP
alone: the MoE's input is gathered over the TP group (every TP rank routes the same tokens, so the
router, its balance loss and the tokens-per-expert counts are those of TP alone), TP rank t keeps
the assignments to the experts of the blocks of tp index t and sends them, with the all-to-all,
among the ep ranks of the same tp index; the partial outputs are reduce-scattered back onto
sequence shards after the MoE. Why this rather than splitting each expert's matmuls over tp: whole
experts keep the expert matmuls as large as on one rank (as TP alone does today), the checkpoint
layout stays a plain Shard(0) of the stacked weights (no per-expert column blocks a DCP box cannot
hold), and the all-to-all moves only the 1 / tp of the assignments each TP rank keeps. An expert's
gradient is the sum over the tokens of the ep ranks' batches (TP ranks of one group hold the same
batch, and only one of them sends an assignment to it), so the scale stays 1 / ep.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its gradient goes back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(in_splits[:r]) : ...] go to rank r of `group`; returns the rows received, source-rank-major."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def expert_weights(weights: list[torch.Tensor], group) -> list[torch.Tensor]:
    """This rank's shards of the expert weights (DTensors on the ep mesh), their gradients scaled by 1 / ep.

    An expert's gradient here is the sum over the tokens of every ep rank (the all-to-all's backward),
    and FSDP then averages it over the ranks holding the same expert; the scale makes the result the
    average over all data-parallel ranks, as for the dense weights (exact for powers of 2; a gradient
    divide factor on FSDP would do the same, but gloo has no pre-multiplied sum)."""
    factor = 1.0 / dist.get_world_size(group)
    return [_ScaleGrad.apply(w.to_local(), factor) for w in weights]


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [E] (this rank's assignments per expert) -> [ep, E / ep]: row s holds what rank s sends
    to each of this rank's experts."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def is_moe(module: nn.Module) -> bool:
    return hasattr(module, "num_experts") and all(
        isinstance(getattr(module, n, None), nn.Parameter) for n in EXPERT_WEIGHTS
    )


def apply_ep(model: nn.Module, expert_mesh: DeviceMesh, ep_mesh: DeviceMesh) -> None:
    """Split every MoE block's routed experts evenly over `expert_mesh` (whole experts per rank; the
    ep mesh, or the flattened (ep, tp) under EP x TP); tokens move over `ep_mesh`."""
    for module in model.modules():
        if not is_moe(module):
            continue
        for name in EXPERT_WEIGHTS:
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(getattr(module, name), expert_mesh, [Shard(0)]))
            )
        module.ep_group = ep_mesh.get_group()


def expert_fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The MoE modules whose experts apply_ep split: FSDP shards them over the ranks holding the same experts."""
    return [m for m in model.modules() if is_moe(m) and getattr(m, "ep_group", None) is not None]
