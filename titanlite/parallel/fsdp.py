"""FSDP2: shard every block, then the root, with the config's mixed precision (autocast where there is no FSDP)."""

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlite.dtypes import DTYPES
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.offload import fsdp_offload_policy


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: str, reduce_dtype: str, reshard_after_forward: str,
               cpu_offload: bool = False) -> None:
    """`mesh` has dims (dp_replicate, dp_shard); with more than one replica FSDP becomes HSDP.

    reshard_after_forward: "always" frees every gathered block after its forward; "never" keeps
    them (ZeRO-2-like: more memory, no re-gather in backward); "default" frees all but the last
    block and the root, whose parameters backward needs first anyway.
    cpu_offload keeps the shards, their gradients and the optimizer state in CPU memory.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = fsdp_offload_policy(cpu_offload)
    dp_mesh = mesh if mesh.size(0) > 1 else mesh["dp_shard"]
    n_blocks = len(model.layers)
    for index, block in enumerate(model.layers.values()):
        reshard = {"always": True, "never": False, "default": index < n_blocks - 1}[reshard_after_forward]
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward == "always",
                offload_policy=offload)


def mixed_precision_context(dims: ParallelDims, param_dtype: str, device_type: str):
    """Without FSDP there is no MixedPrecisionPolicy, so low precision comes from autocast."""
    if dims.fsdp_enabled or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[param_dtype])
