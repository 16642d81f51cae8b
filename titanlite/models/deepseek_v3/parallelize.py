"""DeepSeek-V3's tensor-parallel plan: multi-head latent attention split on heads, the dense
feed-forward as Llama's, and the MoE blocks as Mixtral's (whole routed experts per TP rank, the
router replicated) with the shared experts split like a dense SwiGLU whose output stays a partial
sum, reduce-scattered together with the routed experts' partial sums.

MLA on tp ranks: the up projections wq_b (or wq) and wkv_b are column-wise, whole heads per rank
(TP divides n_heads), and wo row-wise back onto sequence shards. The low-rank down projections
wq_a, wkv_a and their norms are small (rank x dim) and run whole on every rank, on the gathered
sequence, with replicated weights. Their outputs' gradients must be whole on every rank for their
weights' gradients to be: the column-wise wq_b / wkv_b all-reduce the gradients of their inputs,
and the rope key, which every head reads but each rank reads only for its own heads, gets its
gradient summed over the ranks explicitly (Replicated with rope_dim, on wkv_a).
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, SequenceParallel

from titanlite.models.llama.parallelize import swiglu_plan
from titanlite.models.mixtral.parallelize import ExpertParallel, _sum_grads
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import (
    apply_tp_plan,
    colwise,
    gather_sequence,
    parallelize_block,
    rowwise_to_sequence,
    vocab_parallel_plan,
)


class Replicated(ParallelStyle):
    """The whole module on every rank: replicated weights, a plain tensor out. With `rope_dim`, the
    last rope_dim output features (wkv_a's rope key) get their gradient summed over the ranks."""

    def __init__(self, rope_dim: int = 0):
        super().__init__()
        self.rope_dim = rope_dim

    @staticmethod
    def _input(module, inputs, mesh):
        x = inputs[0]
        return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False),)

    def _output(self, module, output, mesh):
        output = output.to_local()
        if not self.rope_dim:
            return output
        latent, rope_key = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, _sum_grads(rope_key, mesh)], dim=-1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition function: distribute_module replicates every parameter.
        return distribute_module(module, device_mesh, None, self._input, self._output)


def attention_plan(q_lora_rank: int, rope_dim: int) -> dict:
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence(extra_inputs=3),  # the RoPE tables and the mask pass as they are
        "attention.wkv_a": Replicated(rope_dim=rope_dim),
        "attention.kv_norm": Replicated(),
        "attention.wkv_b": colwise(),
        "attention.wo": rowwise_to_sequence(),
        "ffn_norm": SequenceParallel(),
    }
    if q_lora_rank:
        plan.update({"attention.wq_a": Replicated(), "attention.q_norm": Replicated(), "attention.wq_b": colwise()})
    else:
        plan["attention.wq"] = colwise()
    return plan


MOE_PLAN = {  # the shared experts first: ExpertParallel replicates every parameter it finds undistributed
    "feed_forward.shared_experts.w1": colwise(),
    "feed_forward.shared_experts.w3": colwise(),
    "feed_forward.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
    "feed_forward": ExpertParallel(),
}


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    args = model.args
    apply_tp_plan(
        model,
        dims.tp_mesh,
        vocab_parallel_plan(loss_parallel),
        attention_plan(args.q_lora_rank, args.qk_rope_head_dim),
        sequence_parallel,
    )
    for layer_id, block in model.layers.items():
        if not model.is_moe(layer_id):
            parallelize_block(block, dims.tp_mesh, swiglu_plan(), sequence_parallel)
            continue
        parallelize_block(block, dims.tp_mesh, MOE_PLAN, sequence_parallel)
        # The routing bias stays a plain tensor, the same on every rank (the router runs on local tensors).
        moe = block.feed_forward
        moe.expert_bias = moe.expert_bias.to_local()
