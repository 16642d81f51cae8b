"""Mixtral's tensor-parallel plan: Llama's attention plan, and the experts split over the TP ranks.

Expert parallelism rather than splitting every expert's hidden dimension: each TP rank holds
num_experts / tp whole experts (a plain Shard(0) of the stacked [experts * out, in] weights, so
init, FSDP and checkpoints see ordinary DTensors) and runs only the tokens routed to them, so the
expert matmuls stay as large as in a 1-rank run instead of shrinking by tp. The router is
replicated: every rank routes the whole (gathered) sequence identically.
"""

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titanlite.models.llama.parallelize import attention_plan
from titanlite.models.moe import experts_forward, experts_forward_over_ranks
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.ep import expert_weights
from titanlite.parallel.tp import apply_tp_plan, vocab_parallel_plan


def _sum_grads(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the TP ranks (each holds a part of it)."""
    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _local_experts(moe: nn.Module, x, weights, experts, counts) -> torch.Tensor:
    """MoE.run_experts on this TP rank's experts only: a partial sum of each token's output.

    TP alone: rank t holds expert block t. EP x TP (moe.ep_group set): the blocks are over the
    flattened (ep, tp) mesh, rank (e, t) holding block e * tp + t; TP rank t keeps the assignments to
    blocks of tp index t, renumbered among them (block e * tp + t becomes e), and exchanges them with
    the ep ranks of its tp index (titanlite/parallel/ep.py says why this layout)."""
    mesh = moe.tp_mesh
    tp, tp_rank = mesh.size(), mesh.get_local_rank()
    per_rank = moe.num_experts // (tp * (1 if moe.ep_group is None else dist.get_world_size(moe.ep_group)))
    # x and the routing weights feed every TP rank's experts: their gradients are partial sums.
    x, weights = _sum_grads(x, mesh), _sum_grads(weights, mesh)
    block = experts // per_rank
    mine = block % tp == tp_rank
    local_ids = (block // tp) * per_rank + experts % per_rank  # among the experts of tp index tp_rank
    local_counts = counts.view(-1, tp, per_rank)[:, tp_rank].flatten()
    tokens = mine.nonzero()[:, 0]  # the token of each local assignment, in (token, slot) order
    inputs = (x[tokens], weights[mine][:, None], local_ids[mine][:, None], local_counts)
    if moe.ep_group is not None:
        w1, w2, w3 = (w.view(per_rank, -1, w.shape[-1]) for w in expert_weights([moe.w1, moe.w2, moe.w3], moe.ep_group))
        out = experts_forward_over_ranks(*inputs, w1, w2, w3, moe.ep_group)
    else:
        w1, w2, w3 = (w.to_local().view(per_rank, -1, w.shape[-1]) for w in (moe.w1, moe.w2, moe.w3))
        out = experts_forward(*inputs, w1, w2, w3)
    return torch.zeros_like(x).index_add_(0, tokens, out)


class ExpertParallel(ParallelStyle):
    """The MoE module: sequence shards in, whole sequence routed on every rank, each rank's partial
    output reduce-scattered back onto sequence shards; the balance loss and counts are identical on
    every rank and pass through. Without `sequence_parallel` (generation's decode, parallel/tp.py's decode_style)
    the whole sequence comes in and the partial outputs are all-reduced."""

    def __init__(self):
        super().__init__()
        self.sequence_parallel = True

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # called for every submodule too; the MoE itself places them all
            return
        for param_name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):  # under EP x TP, apply_ep has split them over (ep, tp) already
                module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))
        module.gate.weight = nn.Parameter(distribute_tensor(module.gate.weight, mesh, [Replicate()]))

    def _input(self, module, inputs, mesh):
        x = inputs[0]
        if not self.sequence_parallel:
            return (x,)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        # Every rank computes the same gradient for the gathered input, so its backward only splits.
        return (x.redistribute(mesh, [Replicate()]).to_local(),)

    def _output(self, module, outputs, mesh):
        out, aux_loss, counts = outputs
        summed = Shard(1) if self.sequence_parallel else Replicate()
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [summed]).to_local()
        return out, aux_loss, counts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = distribute_module(module, device_mesh, self._partition, self._input, self._output)
        gate = module.gate
        gate.forward = lambda x: nn.functional.linear(x, gate.weight.to_local())
        module.tp_mesh = device_mesh
        module.run_experts = types.MethodType(_local_experts, module)
        return module


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    block_plan = {**attention_plan(), "feed_forward": ExpertParallel()}
    apply_tp_plan(model, dims.tp_mesh, vocab_parallel_plan(loss_parallel), block_plan, sequence_parallel)
