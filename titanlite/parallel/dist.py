"""The one place that decides the device and the collective backend.

CUDA + NCCL where a GPU is present, CPU + gloo otherwise. Under torchrun the rank and world
come from its environment; run as a plain `python -m titanlite.train`, the job is a world of
one with an in-memory store, so the same code path (DeviceMesh, collectives, DCP) runs either way.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def init_distributed() -> DistInfo:
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside NCCL so CPU tensors (small bookkeeping collectives) also work.
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, local_rank, world_size, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
