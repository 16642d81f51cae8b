"""GPT-2's tensor-parallel plan: Llama's layout with a fused, head-aligned q/k/v and learned positions."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

from titanlite.errors import UserError
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import (
    RowsByGroups,
    apply_tp_plan,
    colwise,
    gather_sequence,
    rowwise_to_sequence,
    vocab_parallel_plan,
)


def apply_tp(model: nn.Module, dims: ParallelDims, loss_parallel: bool, sequence_parallel: bool = True) -> None:
    """wqkv by whole heads (each rank computes the matching q, k and v rows of a replicated weight,
    see RowsByGroups), wo and w2 row-wise,
    w1 column-wise, LayerNorms sequence-parallel. The position table is split by positions and its
    output reduce-scattered over the sequence, so each rank adds its own positions' rows."""
    if model.args.reset_position_ids:
        raise UserError(
            f"gpt2 with model.reset_position_ids and parallelism.tensor_parallel_degree {dims.tp} is not supported yet "
            "(its position table is split by positions); turn one of them off"
        )
    top_plan = {
        **vocab_parallel_plan(loss_parallel),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
    }
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence(extra_inputs=1),  # the attention mask passes through
        "attention.wqkv": RowsByGroups(3),
        "attention.wo": rowwise_to_sequence(),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather_sequence(),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise_to_sequence(),
    }
    apply_tp_plan(model, dims.tp_mesh, top_plan, block_plan, sequence_parallel)
