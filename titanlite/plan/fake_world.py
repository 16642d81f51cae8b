"""The trainer's own build + parallelize, on the meta device under a fake process group of the
full world size, in one process: the shards it leaves on a rank are the real ones, no byte allocated.

torch's "fake" backend (torch.testing._internal.distributed.fake_pg, also used by torch's own
FSDP memory tests) accepts every collective and does nothing, so DeviceMesh, FSDP2 and TP build
exactly as on the cluster. Features that only refuse to build without a GPU (float8, async TP,
CPU offload's pinned memory) are left out of the build: none changes a shard's size.
"""

import contextlib
import dataclasses

import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.config_sections import JobConfig
from titanlite.models.construct import meta_model, parallelizer
from titanlite.models.init import local_tensor
from titanlite.optim.muon import muon_trains
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import ParallelizeSettings
from titanlite.parallel.pp import RankModel, stage_parts

# Optimizer states per parameter, each shaped and typed like the parameter (optim.py, bf16_adamw.py),
# plus one float32 step counter per parameter; Muon's matrices (muon.py) keep one momentum buffer and no
# counter, its other parameters AdamW's two moments and counter.
MOMENTS = {"AdamW": 2, "Adam": 2, "AdamWBF16Kahan": 3, "Muon": 2}
MUON_MOMENTS = 1
STEP_BYTES = 4


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A default process group of world_size ranks in which this process is `rank` (rank 0 of a mesh
    dimension holds its largest shards)."""
    if dist.is_initialized():
        raise RuntimeError("the planner needs its own (fake) process group; plan before init_process_group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def buildable(cfg: JobConfig) -> ParallelizeSettings:
    """cfg's parallelize settings minus what cannot be built without a GPU and does not change shard sizes."""
    settings = ParallelizeSettings.of(cfg)
    return dataclasses.replace(
        settings,
        float8=dataclasses.replace(cfg.float8, enable=False),
        parallelism=dataclasses.replace(cfg.parallelism, enable_async_tensor_parallel=False, fsdp_cpu_offload=False),
    )


def sharded_model(cfg: JobConfig, spec, args, dims: ParallelDims) -> nn.Module:
    """This rank's model (under PP: its stages) as build.build_model leaves it before allocation
    (dims' mesh must exist)."""
    model = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    parallelize = parallelizer(spec, dims, buildable(cfg))
    if dims.pp_enabled:
        _, parts = stage_parts(model, dims, cfg.parallelism, cfg.training.local_batch_size, parallelize)
        return RankModel(list(parts.values()))
    return parallelize(model)


def state_bytes(model: nn.Module, optimizer_name: str) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, as profiling.model_state_bytes
    counts them after a step (gradients and moments are like their parameter's local shard)."""
    params = [local_tensor(p) for p in model.parameters()]
    trained = {n: local_tensor(p) for n, p in model.named_parameters() if p.requires_grad}  # LoRA: the adapters only
    muon = {n for n in trained if optimizer_name == "Muon" and muon_trains(n, trained[n])}
    shard = sum(p.numel() * p.element_size() for p in trained.values())
    muon_shard = sum(trained[n].numel() * trained[n].element_size() for n in muon)
    optimizer = MOMENTS[optimizer_name] * (shard - muon_shard) + MUON_MOMENTS * muon_shard
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": shard,
        "optimizer": optimizer + STEP_BYTES * (len(trained) - len(muon)),
    }
