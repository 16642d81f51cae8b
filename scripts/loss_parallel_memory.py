"""Peak memory of the cross-entropy on vocab-sharded logits (torch's loss_parallel) against the plain kernels,
in fp32 copies of the logits, forward and backward, tallied op by op on real CPU tensors by the planner's own
counter (plan/activations.py's LiveBytes). A 1-rank mesh runs loss_parallel's ops as an 8-rank one does, on
this rank's slice. docs/benchmarks.md quotes its output:

    python scripts/loss_parallel_memory.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlite.loss import loss_parallel_context
from titanlite.plan.activations import LiveBytes

BATCH, SEQ, VOCAB = 2, 64, 4096


def peaks(mesh) -> tuple[float, float]:
    """(forward, backward) peak in fp32 copies of the logits; `mesh` None runs the plain kernels."""
    logits = torch.randn(BATCH, SEQ, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    logits_in = distribute_tensor(logits, mesh, [Shard(-1)]) if mesh is not None else logits
    tally = LiveBytes(1, [logits, labels])
    with loss_parallel_context(mesh is not None), tally:
        loss = F.cross_entropy(logits_in.flatten(0, 1).float(), labels.flatten())  # as cross_entropy_loss does
        forward = tally.peak
        loss.backward()
    copy = BATCH * SEQ * VOCAB * 4
    return forward / copy, tally.peak / copy


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain, parallel = peaks(None), peaks(mesh)
    print(
        f"torch {torch.__version__}: peak fp32 logits copies (forward, backward): plain kernels "
        f"{plain[0]:.1f}, {plain[1]:.1f}; loss_parallel {parallel[0]:.1f}, {parallel[1]:.1f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
