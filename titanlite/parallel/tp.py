"""Tensor + sequence parallelism: the generic styles every family's TP plan is built from.

Megatron's layout: between blocks the activations are sharded on the sequence (dim 1), so the
norms run on T / tp tokens each (SequenceParallel); a block's input is all-gathered into the
column-wise projections and its row-wise output projection reduce-scatters back to sequence
shards. The token embedding is vocab-sharded (row-wise) and the output projection vocab-sharded
(column-wise), so with loss parallel the full-vocabulary logits never exist on one rank.

Generation decodes one token per row, which no sequence split can share out, so a family's plan applied with
`sequence_parallel=False` (decode_style) keeps every weight's layout, and so each rank's heads, but keeps the
activations whole between the blocks: the row-wise projections all-reduce, and the logits are all-gathered, each
projection computing on its local shard as a plain tensor (LocalShards).
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.config_sections import Parallelism
from titanlite.errors import UserError


def check_tensor_parallel(cfg: Parallelism, device_type: str, compile_enabled: bool) -> None:
    if cfg.enable_async_tensor_parallel and cfg.tensor_parallel_degree == 1:
        raise UserError(
            "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree above 1; set one of them"
        )
    if cfg.enable_async_tensor_parallel and (device_type != "cuda" or not compile_enabled):
        raise UserError(
            f"parallelism.enable_async_tensor_parallel needs CUDA and compile.enable (this run: {device_type}, "
            f"compile {'on' if compile_enabled else 'off'}); set it to false"
        )


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor micro-pipeline each TP all-gather/reduce-scatter with its matmul (symmetric memory)."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def vocab_parallel_plan(loss_parallel_enabled: bool) -> dict[str, ParallelStyle]:
    """tok_embeddings row-wise into sequence shards, the final norm sequence-parallel, the output
    column-wise: vocab-sharded logits (a DTensor) for loss parallel, else gathered plain logits."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel_enabled else Replicate(),
            use_local_output=not loss_parallel_enabled,
        ),
    }


def gather_sequence(extra_inputs: int = 0) -> PrepareModuleInput:
    """A sub-block's input: sequence shards all-gathered to the whole sequence; `extra_inputs`
    further positional arguments (e.g. RoPE tables) pass through untouched."""
    return PrepareModuleInput(
        input_layouts=(Shard(1),) + (None,) * extra_inputs,
        desired_input_layouts=(Replicate(),) + (None,) * extra_inputs,
    )


def colwise() -> ColwiseParallel:
    return ColwiseParallel()


def rowwise_to_sequence() -> RowwiseParallel:
    """The last projection of a sub-block: partial sums reduce-scattered onto sequence shards."""
    return RowwiseParallel(output_layouts=Shard(1))


class RowsByGroups(ParallelStyle):
    """Column-wise parallel for a fused projection whose output rows are `groups` equal parts (q, k, v):
    every rank computes the matching rows of each part (whole heads of q, k and v), so the module reads
    its local output exactly as the unfused one would.

    The weight and bias are replicated and each rank slices its rows in forward: a rank's rows are
    several ranges, which a DCP checkpoint cannot store (one box per rank) and FSDP's dim-0 chunks would
    straddle. The price: the whole q/k/v weight on every TP rank (FSDP still shards it over the data
    ranks) and an all-reduce of its gradient over the TP ranks.
    """

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

    @staticmethod
    def _input(module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        # Each rank's input-gradient is a partial sum over its rows; the sequence gather's backward sums them.
        return (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]),)

    def _local_rows(self, param: DTensor) -> torch.Tensor:
        """This rank's rows of each part; their gradient is zero elsewhere, so the ranks' partial sums add up."""
        mesh = param.device_mesh
        parts = param.to_local(grad_placements=[Partial()]).unflatten(0, (self.groups, mesh.size(), -1))
        return parts[:, mesh.get_local_rank()].flatten(0, 1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = distribute_module(module, device_mesh, self._partition, self._input)
        module.forward = lambda x: nn.functional.linear(
            x, self._local_rows(module.weight), None if module.bias is None else self._local_rows(module.bias)
        )
        return module


def _float8_linear_class():
    """torchao's Float8Linear, or None where float8 conversion never ran (torchao not imported, maybe not installed)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return None if module is None else module.Float8Linear


def _is_tensorwise(linear: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity

    return linear.config.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE


def _refuse_float8_under_rows_by_groups(module: nn.Module, plan: dict[str, ParallelStyle], float8_linear) -> None:
    """RowsByGroups replaces the module's forward by its own matmul: a float8 linear there (GPT-2's
    fused q/k/v) would silently multiply in high precision, so it is refused."""
    for fqn, style in plan.items():
        if isinstance(style, RowsByGroups) and isinstance(module.get_submodule(fqn), float8_linear):
            raise UserError(
                f"float8.enable cannot run {fqn} (split by RowsByGroups, which computes its own matmul) in float8 "
                "under "
                f'parallelism.tensor_parallel_degree above 1: add "{fqn.split(".")[-1]}" to float8.filter_fqns'
            )


def with_float8_styles(
    module: nn.Module, plan: dict[str, ParallelStyle], float8_collectives: bool
) -> dict[str, ParallelStyle]:
    """The plan with torchao's float8 TP styles where float8 linears run under the tensorwise recipe.

    Float8ColwiseParallel / Float8RowwiseParallel cast a linear's input to float8 before its
    all-gather and its output gradient before the backward's collective (half the bytes of bf16);
    a sequence gather (PrepareModuleInput) whose module's linears are all float8 column/row-wise
    casts once, before gathering, for all of them. The numbers are those of the plain styles, where
    Float8Linear casts after the gather: a tensorwise scale comes from the amax of the whole
    DTensor either way. So the plain styles stay where the collectives cannot carry float8
    (`float8_collectives` false: gloo, the CPU's emulated float8), for the rowwise recipe, whose
    per-row scales torchao's styles do not compute (as torchtitan does), and under any other style
    (DeepSeek-V3's Replicated runs Float8Linear's own forward on replicated weights).
    """
    float8_linear = _float8_linear_class()
    if float8_linear is None:
        return plan
    _refuse_float8_under_rows_by_groups(module, plan, float8_linear)
    if not float8_collectives:
        return plan
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def tensorwise_float8(target: nn.Module) -> bool:
        return isinstance(target, float8_linear) and _is_tensorwise(target)

    def linears_all_float8(prefix: str, target: nn.Module) -> bool:
        linears = {f"{prefix}.{name}": m for name, m in target.named_modules() if isinstance(m, nn.Linear)}
        return bool(linears) and all(
            tensorwise_float8(m) and isinstance(plan.get(fqn), (ColwiseParallel, RowwiseParallel))
            for fqn, m in linears.items()
        )

    swapped = {}
    for fqn, style in plan.items():
        target = module.get_submodule(fqn)
        if tensorwise_float8(target) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            float8_style = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            style = float8_style(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput and style.input_layouts and linears_all_float8(fqn, target):
            style = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                use_local_output=style.use_local_output,
            )
        swapped[fqn] = style
    return swapped


class LocalShards(ParallelStyle):
    """Generation's form of a column- or row-wise linear, or a row-wise (vocabulary- or position-sharded) embedding:
    the weight is laid out as training lays it out (a DTensor, which rl/engine.py's copy fills with this rank's shard),
    but the forward computes on its local shard as a plain tensor and makes its one collective itself: DTensor's
    dispatch of every op costs more than a decode step's small matmuls. `rows`: the weight is split on its input
    (a linear's dim 1, an embedding's rows) and the partial outputs are summed (all-reduced; `partial`: left partial
    for a later sum, the bias added by TP rank 0 only); otherwise on its output, which is all-gathered with `gather`
    (the logits) or handed on local (this rank's heads or features)."""

    def __init__(self, rows: bool, gather: bool = False, partial: bool = False):
        super().__init__()
        self.rows, self.gather, self.partial = rows, gather, partial

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param_name == "weight":  # as Rowwise/ColwiseParallel lay them out
                placement = Shard(1) if self.rows and not isinstance(module, nn.Embedding) else Shard(0)
            else:  # the bias: whole under row-wise (added once), split with the outputs under column-wise
                placement = Replicate() if self.rows else Shard(0)
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = distribute_module(module, device_mesh, self._partition)
        group = device_mesh.get_group()
        if isinstance(module, nn.Embedding):
            module.forward = lambda ids: sharded_lookup(ids, module.weight, group)
        elif self.rows:
            module.forward = lambda x: summed_rows(x, module, group, self.partial)
        else:
            module.forward = lambda x: local_columns(x, module, group, self.gather)
        return module


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A bias as LocalShards computes with it: this rank's part (or the whole, replicated), None where there is none."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_lookup(ids: torch.Tensor, weight: DTensor, group) -> torch.Tensor:
    """An embedding whose rows are split over the group: each rank looks up the ids it holds, zeros elsewhere, and
    the ranks' lookups are summed."""
    rows = weight.to_local()
    start = dist.get_rank(group) * -(-weight.shape[0] // dist.get_world_size(group))  # torch.chunk's split
    shifted = ids - start
    held = (shifted >= 0) & (shifted < rows.shape[0])
    out = nn.functional.embedding(torch.where(held, shifted, 0), rows) * held[..., None]
    dist.all_reduce(out, group=group)
    return out


def summed_rows(x: torch.Tensor, module: nn.Module, group, partial: bool) -> torch.Tensor:
    out = nn.functional.linear(x, module.weight.to_local())
    if not partial:
        dist.all_reduce(out, group=group)
    if module.bias is not None and (not partial or dist.get_rank(group) == 0):
        out = out + local(module.bias)
    return out


def local_columns(x: torch.Tensor, module: nn.Module, group, gather: bool) -> torch.Tensor:
    out = nn.functional.linear(x, module.weight.to_local(), local(module.bias))
    if not gather:
        return out
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def decode_style(style: ParallelStyle) -> ParallelStyle | None:
    """The style a module takes in the plan generation decodes with: its weights laid out as in training, its
    activations whole. None: the module runs as it is (a norm, or a sequence gather there is no need of). Column-wise
    and row-wise projections become LocalShards: the column-wise ones hand on their local heads or features (the
    vocabulary-sharded logits all-gathered), the row-wise ones (and the vocabulary-sharded embedding) all-reduce
    their partial sums, unless training left them partial for a later sum; a family's own style with a
    `sequence_parallel` switch (Mixtral's experts) gets it turned off, any other (RowsByGroups, DeepSeek's
    Replicated) takes whole activations already."""
    if isinstance(style, SequenceParallel) or type(style) is PrepareModuleInput:
        return None
    if isinstance(style, ColwiseParallel):
        return LocalShards(rows=False, gather=not style.use_local_output or style.output_layouts[0] == Replicate())
    if isinstance(style, RowwiseParallel):
        return LocalShards(rows=True, partial=isinstance(style.output_layouts[0], Partial))
    if hasattr(style, "sequence_parallel"):
        style = copy.copy(style)
        style.sequence_parallel = False
    return style


def parallelize_block(
    module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle], sequence_parallel: bool = True
) -> None:
    """parallelize_module with the float8 styles swapped in where float8 linears take part (gloo,
    the CPU's backend, has no float8 dtypes); without `sequence_parallel`, the decode's styles (decode_style)."""
    if not sequence_parallel:
        plan = {fqn: style for fqn, style in ((f, decode_style(s)) for f, s in plan.items()) if style is not None}
    parallelize_module(
        module, tp_mesh, with_float8_styles(module, plan, float8_collectives=tp_mesh.device_type != "cpu")
    )


def apply_tp_plan(
    model: nn.Module, tp_mesh: DeviceMesh, top_plan: dict, block_plan: dict, sequence_parallel: bool = True
) -> None:
    """Apply the model-level plan, then the same block plan to every block in model.layers; a
    pipeline stage's absent modules (None) are left out of the plan. sequence_parallel=False: generation's plan
    (decode_style)."""
    present = {name: style for name, style in top_plan.items() if getattr(model, name) is not None}
    parallelize_block(model, tp_mesh, present, sequence_parallel)
    for block in model.layers.values():
        parallelize_block(block, tp_mesh, block_plan, sequence_parallel)
    if getattr(model.args, "tie_embeddings", False):
        # Each style distributed its own copy of the tied matrix (both vocab-sharded on dim 0): tie again.
        model.output.weight = model.tok_embeddings.weight


def place_grads_like_params(model: nn.Module) -> None:
    """The row-wise embedding's backward yields a Replicate gradient for its Shard(0) weight: the
    whole vocab x dim matrix on every TP rank until the optimizer step (1.1 MB on the debug model,
    4 GB for a 128k x 8192 fp32 gradient). Each gradient takes its parameter's placement as soon as
    it is accumulated: from Replicate, a local slice, no communication. Registered once the
    parameters are allocated (to_empty swaps the meta tensors out, hooks and all); FSDP's sharded
    parameters get their gradients from FSDP, already placed, so the hook never runs for them."""
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(place_grad_like_param)


def place_grad_like_param(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def tp_shard(param: torch.Tensor, like: DTensor) -> DTensor:
    """The policy's `param` (a DTensor over FSDP's and TP's ranks, or a plain tensor) as a DTensor laid out as `like`
    (a parameter of generation's copy, on the TP mesh): where param is split over the TP ranks as like is, FSDP's
    shards are gathered and this rank's TP shard kept (no TP traffic); otherwise (Mixtral's experts under EP x TP,
    split over (ep, tp)) the whole tensor is gathered and this rank's shard of it kept."""
    mesh, placement = like.device_mesh, like.placements[0]
    if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ()):
        at = param.device_mesh.mesh_dim_names.index("tp")
        if param.placements[at] == placement:
            gathered = [placement if dim == at else Replicate() for dim in range(param.device_mesh.ndim)]
            shard = param.redistribute(param.device_mesh, gathered).to_local()
            return DTensor.from_local(shard, mesh, [placement], run_check=False, shape=like.shape, stride=like.stride())
    whole = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return distribute_tensor(whole, mesh, [placement], src_data_rank=None)
