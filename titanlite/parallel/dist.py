"""The one place that decides the device and the collective backend.

CUDA + NCCL where a GPU is present, CPU + gloo otherwise. Under torchrun the rank and world
come from its environment; run as a plain `python -m titanlite.train`, the job is a world of
one with an in-memory store, so the same code path (DeviceMesh, collectives, DCP) runs either way.
"""

import os
import re
from dataclasses import dataclass
from datetime import timedelta

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


def meet_without_torchrun(rank: int, world_size: int, timeout_s: int) -> dist.TCPStore:
    """Ranks started by hand (or by Slurm/Kubernetes without torchrun) meet at rank 0's store;
    a rank that never starts would hang the others for torch's 30 minutes without a word."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    try:
        return dist.TCPStore(addr, port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=True)
    except dist.DistError as error:
        joined = re.search(r"(\d+)/\d+ clients joined", str(error))  # rank 0 counts who came
        who = (f"{joined.group(1)} joined, {world_size - int(joined.group(1))} missing" if joined
               else f"rank {rank} could not reach rank 0 there")
        raise UserError(
            f"the {world_size} ranks (WORLD_SIZE) did not meet at MASTER_ADDR:MASTER_PORT {addr}:{port} within "
            f"job.init_timeout_seconds {timeout_s}: {who}; start every RANK from 0 to {world_size - 1} with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise job.init_timeout_seconds"
        ) from None


def init_distributed(init_timeout_s: int) -> DistInfo:
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
        # With torchrun's shared store (its default) its agent has already gathered every worker.
        store = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else meet_without_torchrun(rank, world_size, init_timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, world_size, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
