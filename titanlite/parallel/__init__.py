"""Parallelism applied from outside the model: parallelize_decoder composes the generic pieces."""

import contextlib

import torch
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.parallel.ac import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.fsdp import DTYPES, apply_fsdp
from titanlite.parallel.offload import check_fsdp_offload


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """For any decoder with model.layers: float8 -> (TP, when it lands) -> AC -> compile -> FSDP.

    float8 swaps Linear modules, so it goes first; AC wraps each block and compile then traces the
    wrapped block (recompute included); FSDP goes last, its hooks outside the compiled code.
    """
    check_fsdp_offload(cfg.parallelism.fsdp_cpu_offload, dims.fsdp_enabled)
    apply_float8(model, cfg.float8)
    apply_ac(model, cfg.activation_checkpoint)
    apply_compile(model, cfg.compile)
    if dims.fsdp_enabled:
        training = cfg.training
        apply_fsdp(model, dims.mesh, training.mixed_precision_param, training.mixed_precision_reduce,
                   cfg.parallelism.fsdp_reshard_after_forward, cpu_offload=cfg.parallelism.fsdp_cpu_offload)
    return model


def mixed_precision_context(dims: ParallelDims, param_dtype: str, device_type: str):
    """Without FSDP there is no MixedPrecisionPolicy, so low precision comes from autocast."""
    if dims.fsdp_enabled or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[param_dtype])
