"""The one place that decides the device and the collective backend.

CUDA + NCCL where a GPU is present, CPU + gloo otherwise. Under torchrun the rank and world
come from its environment; run as a plain `python -m titanlite.train`, the job is a world of
one with an in-memory store, so the same code path (DeviceMesh, collectives, DCP) runs either way.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device


def check_restartable() -> None:
    """torchrun --max-restarts with its rendezvous store shared with the workers (torch's default
    since 2.5) brings the restarted workers up on the failed attempt's keys in that store: they read
    the dead processes' addresses and cannot connect (pytorch/pytorch#135712, #167288). Stop at
    the start rather than at the first failure, hours later."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UserError(
            f"torchrun --max-restarts {restarts} needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
            "(with torch's shared rendezvous store, restarted workers read the failed attempt's addresses and cannot "
            "connect); export it before torchrun, as scripts/run_train.sh and multinode_trainer.slurm do, and use "
            "the c10d rendezvous (--standalone or --rdzv-backend c10d)"
        )


def init_distributed() -> DistInfo:
    check_restartable()
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
    return DistInfo(rank, world_size, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
