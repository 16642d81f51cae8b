"""torchrun tests/cp_gather_stress.py N: N steps of context parallelism's key and value gathers, four blocks' at a time,
(parallel/cp.py's sequence_shard) and their backward on gloo; exits 0 when every step ran. Before the gathers
waited one at a time on the CPU, a rank aborted within a few thousand steps (heap corruption)."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titanlite.parallel.cp import sequence_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
shard = sequence_shard(64, mesh, "cpu")
for _ in range(int(sys.argv[1])):
    # A block's keys and values, four blocks at once: every gather is issued before any is used.
    inputs = [torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(8)]
    gathered = [shard.gather(x) for x in inputs]
    sum((a * b).sum() for a, b in zip(gathered[::2], gathered[1::2])).backward()
dist.destroy_process_group()
