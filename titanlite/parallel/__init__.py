"""Parallelism applied from outside the model: parallelize_decoder composes the generic pieces."""

import contextlib
from typing import Callable

import torch
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.parallel.ac import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.fsdp import DTYPES, apply_fsdp
from titanlite.parallel.offload import check_fsdp_offload
from titanlite.parallel.tp import check_tensor_parallel, enable_async_tp


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig, apply_tp: Callable) -> nn.Module:
    """For any decoder with model.layers: float8 -> TP (the family's apply_tp plan) -> AC -> compile -> FSDP.

    float8 swaps Linear modules, so it goes first; TP turns the weights into DTensors on the tp
    mesh, which FSDP then shards again over the dp dims (2D); AC wraps each block and compile then
    traces the wrapped block (recompute included); FSDP goes last, its hooks outside the compiled code.
    """
    check_fsdp_offload(cfg.parallelism.fsdp_cpu_offload, dims.fsdp_enabled)
    apply_float8(model, cfg.float8)
    if dims.tp_enabled or cfg.parallelism.enable_async_tensor_parallel:
        check_tensor_parallel(cfg.parallelism, dims.mesh.device_type, cfg.compile.enable, cfg.float8.enable)
    if dims.tp_enabled:
        dims.check_model(model.args)
        apply_tp(model, dims, loss_parallel=not cfg.parallelism.disable_loss_parallel)
        if cfg.parallelism.enable_async_tensor_parallel:
            enable_async_tp(dims.tp_mesh)
    apply_ac(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    if dims.fsdp_enabled:
        training = cfg.training
        apply_fsdp(model, dims.dp_mesh, training.mixed_precision_param, training.mixed_precision_reduce,
                   cfg.parallelism.fsdp_reshard_after_forward, cpu_offload=cfg.parallelism.fsdp_cpu_offload)
    return model


def mixed_precision_context(dims: ParallelDims, param_dtype: str, device_type: str):
    """Without FSDP there is no MixedPrecisionPolicy, so low precision comes from autocast."""
    if dims.fsdp_enabled or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[param_dtype])
