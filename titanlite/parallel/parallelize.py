"""Parallelism applied from outside the model: parallelize_decoder composes the generic pieces."""

from dataclasses import dataclass
from typing import Callable

from torch import nn

from titanlite.config_sections import ActivationCheckpoint, Compile, Float8, JobConfig, Parallelism
from titanlite.parallel.ac import apply_ac
from titanlite.parallel.compile import apply_compile, compile_without_disk_cache
from titanlite.parallel.cp import apply_cp
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.ep import apply_ep
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.offload import check_fsdp_offload
from titanlite.parallel.tp import check_tensor_parallel, enable_async_tp


@dataclass(frozen=True)
class ParallelizeSettings:
    """The sections parallelize_decoder reads, and training's mixed precision (FSDP's policy)."""

    parallelism: Parallelism
    float8: Float8
    activation_checkpoint: ActivationCheckpoint
    compile: Compile
    param_dtype: str  # training.mixed_precision_param
    reduce_dtype: str  # training.mixed_precision_reduce

    @classmethod
    def of(cls, cfg: JobConfig) -> "ParallelizeSettings":
        return cls(
            cfg.parallelism,
            cfg.float8,
            cfg.activation_checkpoint,
            cfg.compile,
            cfg.training.mixed_precision_param,
            cfg.training.mixed_precision_reduce,
        )


def parallelize_decoder(
    model: nn.Module, dims: ParallelDims, settings: ParallelizeSettings, apply_tp: Callable
) -> nn.Module:
    """For any decoder with model.layers: float8 -> EP -> CP -> TP (the family's apply_tp plan) -> AC -> compile
    -> FSDP. CP changes no weight: it only tells the MoE balance losses which ranks hold the rest of each sequence.

    float8 swaps Linear modules, so it goes first; TP turns the weights into DTensors on the tp
    mesh, which FSDP then shards again over the dp dims (2D); AC wraps each block and compile then
    traces the wrapped block (recompute included); FSDP goes last, its hooks outside the compiled code.
    """
    par = settings.parallelism
    check_fsdp_offload(par.fsdp_cpu_offload, dims.fsdp_enabled)
    apply_float8(model, settings.float8)
    if dims.tp_enabled or par.enable_async_tensor_parallel:
        check_tensor_parallel(par, dims.mesh.device_type, settings.compile.enable)
    if dims.tp_enabled or dims.ep_enabled:
        dims.check_model(model.args)
    if dims.ep_enabled:
        apply_ep(model, dims.expert_mesh, dims.ep_mesh)
    if dims.cp_enabled:
        apply_cp(model, dims.cp_mesh)
    if dims.tp_enabled:
        apply_tp(model, dims, loss_parallel=not par.disable_loss_parallel)
        if par.enable_async_tensor_parallel:
            enable_async_tp(dims.tp_mesh)
    apply_ac(model, settings.activation_checkpoint)
    if settings.compile.enable and (dims.tp_enabled or dims.ep_enabled):
        compile_without_disk_cache()
    apply_compile(model, settings.compile, fullgraph=not dims.ep_enabled)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.dp_mesh,
            settings.param_dtype,
            settings.reduce_dtype,
            par.fsdp_reshard_after_forward,
            cpu_offload=par.fsdp_cpu_offload,
            expert_mesh=dims.expert_fsdp_mesh if dims.ep_enabled else None,
        )
    return model
