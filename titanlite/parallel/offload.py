"""Offloading to CPU memory: FSDP's parameters, gradients and optimizer state, and activations.

- parallelism.fsdp_cpu_offload: FSDP2's CPUOffloadPolicy keeps the sharded parameters, their
  gradients and so the optimizer state in CPU memory (pinned on CUDA); each block's parameters
  are copied to the GPU for its all-gather and its gradients back after the reduce-scatter, and
  the optimizer steps on the CPU. It needs FSDP, i.e. more than one data-parallel rank.
- activation_checkpoint.offload_activations: every tensor the forward saves for backward goes to
  CPU memory (pinned on CUDA) and comes back when backward needs it
  (torch.autograd.graph.save_on_cpu). On a CPU run activations already live in CPU memory: the
  copies are made as asked, but they save nothing, and the run says so at start.
"""

import contextlib

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from titanlite.errors import UserError
from titanlite.log import logger


def fsdp_offload_policy(enabled: bool) -> OffloadPolicy:
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if enabled else OffloadPolicy()


def check_fsdp_offload(enabled: bool, fsdp_enabled: bool) -> None:
    if enabled and not fsdp_enabled:
        raise UserError(
            "parallelism.fsdp_cpu_offload offloads FSDP's shards and needs FSDP, i.e. more than one "
            "data-parallel rank; launch with torchrun --nproc_per_node N, or set it false"
        )


def optimizer_device_type(fsdp_cpu_offload: bool, device_type: str) -> str:
    """Where the optimizer steps: with FSDP offload, the parameters it updates live on the CPU."""
    return "cpu" if fsdp_cpu_offload else device_type


def note_if_offload_saves_nothing(offload_activations: bool, device_type: str) -> None:
    if offload_activations and device_type == "cpu":
        logger.info(
            "activation_checkpoint.offload_activations on a CPU run: activations already live in CPU "
            "memory, so the copies cost time and save nothing"
        )


def activation_offload_context(enabled: bool, device_type: str):
    """Around the forward: saved activations go to CPU memory until backward."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda")
