"""FSDP2: shard every block, then the root, with the config's mixed precision (autocast where there is no FSDP)."""

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlite.dtypes import DTYPES
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.ep import expert_fsdp_units
from titanlite.parallel.offload import fsdp_offload_policy


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """`mesh` has dims (dp_replicate, dp_shard), or dp_shard alone (ParallelDims.dp_mesh; under context
    parallelism dp_shard is the flattened (dp_shard, cp)); with more than one replica FSDP becomes HSDP.

    reshard_after_forward: "always" frees every gathered block after its forward; "never" keeps
    them (ZeRO-2-like: more memory, no re-gather in backward); "default" frees all but the last
    block and the root, whose parameters backward needs first anyway.
    cpu_offload keeps the shards, their gradients and the optimizer state in CPU memory.
    expert_mesh (expert parallelism; dims dp_replicate, efsdp): the experts apply_ep split are sharded
    over it instead, in a unit of their own (the router and shared experts in units over `mesh`).
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = fsdp_offload_policy(cpu_offload)
    n_blocks = len(model.layers)
    for index, block in enumerate(model.layers.values()):
        reshard = {"always": True, "never": False, "default": index < n_blocks - 1}[reshard_after_forward]
        if expert_mesh is not None:
            shard_experts(
                block, mesh, expert_mesh, dict(mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
            )
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=policy,
        reshard_after_forward=reshard_after_forward == "always",
        offload_policy=offload,
    )


# A MoE's output [B, T, D] is a view of its [B * T, D] result; every block adds it out of place, so
# FSDP's warning about in-place ops on a view returned by an FSDP module does not apply.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w*MoE\) returned a view tensor")


def shard_experts(block: nn.Module, dp_mesh: DeviceMesh, expert_mesh: DeviceMesh, options: dict) -> None:
    """The block's MoE in three kinds of units: the router and the shared experts over all data-parallel
    ranks, like the rest of the block, and the routed experts (the MoE's own parameters) over the ranks
    holding the same experts (the MoE's run_experts scales their gradients by 1 / ep, so that FSDP's
    average over these ranks is the average over all data-parallel ranks)."""
    for moe in expert_fsdp_units(block):
        for dense in (moe.gate, getattr(moe, "shared_experts", None)):
            if dense is not None:
                fully_shard(dense, mesh=dp_mesh, **options)
        fully_shard(moe, mesh=expert_mesh, **options)


def mixed_precision_context(dims: ParallelDims, param_dtype: str, device_type: str):
    """Without FSDP there is no MixedPrecisionPolicy, so low precision comes from autocast."""
    if dims.fsdp_enabled or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[param_dtype])
