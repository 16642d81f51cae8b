"""Parallelism applied from outside the model: parallelize_decoder composes the generic pieces."""

import contextlib

import torch
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import DTYPES, apply_fsdp


def parallelize_decoder(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """For any decoder with model.layers: (float8 -> TP -> AC -> compile, as they land) -> FSDP."""
    if dims.fsdp_enabled:
        training = cfg.training
        apply_fsdp(model, dims.mesh, training.mixed_precision_param, training.mixed_precision_reduce,
                   cfg.parallelism.fsdp_reshard_after_forward)
    return model


def mixed_precision_context(dims: ParallelDims, param_dtype: str, device_type: str):
    """Without FSDP there is no MixedPrecisionPolicy, so low precision comes from autocast."""
    if dims.fsdp_enabled or DTYPES[param_dtype] == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[param_dtype])
