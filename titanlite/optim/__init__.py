"""Optimizers and learning-rate schedules."""

import functools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config_sections import LRScheduler, Optimizer
from titanlite.optim.bf16_adamw import build_adamw_bf16_kahan
from titanlite.optim.muon import build_muon

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizer(model: nn.Module, cfg: Optimizer, device_type: str) -> torch.optim.Optimizer:
    """Weight decay applies to matrices only: decaying norm gains pulls them towards zero for nothing."""
    if cfg.name == "Muon":
        return build_muon(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.name == "AdamWBF16Kahan":
        return build_adamw_bf16_kahan(groups, cfg)
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    return _OPTIMIZERS[cfg.name](
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(
    step: int, *, steps: int, warmup_steps: int, decay_type: str, decay_ratio: float, min_lr_factor: float
) -> float:
    """Multiplier of the peak lr used at training step `step` (1-based).

    Linear warmup reaches 1.0 at step warmup_steps; the lr then stays at 1.0 until the last
    decay_ratio share of the remaining steps (all of them when decay_ratio is -1), over which it
    falls to min_lr_factor along the chosen curve, reaching it exactly at the last step.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    after_warmup = max(steps - warmup_steps, 1)
    decay_steps = after_warmup if decay_ratio < 0 else max(round(after_warmup * decay_ratio), 1)
    progress = min(max((step - (steps - decay_steps)) / decay_steps, 0.0), 1.0)
    curve = {
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        "sqrt": 1.0 - math.sqrt(progress),
    }[decay_type]
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, steps: int) -> LambdaLR:
    factor = functools.partial(
        lr_factor,
        steps=steps,
        warmup_steps=cfg.warmup_steps,
        decay_type=cfg.decay_type,
        decay_ratio=cfg.decay_ratio,
        min_lr_factor=cfg.min_lr_factor,
    )
    # LambdaLR counts from 0 and is stepped after each optimizer step: index i serves step i + 1.
    return LambdaLR(optimizer, lambda i: factor(i + 1))


def clip_grad_norm_(
    parameters, max_norm: float, pp_group: dist.ProcessGroup | None = None, uncounted=()
) -> torch.Tensor:
    """Clip to the true global norm; returns that norm (before clipping) as a plain tensor.

    With FSDP the gradients are DTensor shards: their norm is a DTensor whose full_tensor()
    reduces over the shards, so every rank clips by the same, global, factor. Pipeline stages hold
    disjoint parameters: their squared norms add up over the pipeline group, except `uncounted`
    (a tied matrix's copies on the last stage, counted once on the first), which are only clipped.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters if not any(p is u for u in uncounted)]
    total_norm = _global_norm(grads)
    if pp_group is not None:
        squared = total_norm**2
        dist.all_reduce(squared, group=pp_group)
        total_norm = squared.sqrt()
    if max_norm > 0:
        for group in _by_mesh(parameters):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    return total_norm


def _by_mesh(tensors: list) -> list[list]:
    """The tensors grouped by DTensor mesh (plain tensors together): foreach ops take one mesh at a time,
    and expert parallelism puts the experts on a mesh of their own."""
    groups: dict = {}
    for t in tensors:
        key = getattr(t.grad if isinstance(t, torch.nn.Parameter) else t, "device_mesh", None)
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def _global_norm(grads: list) -> torch.Tensor:
    """The 2-norm of all the gradients, whole (each mesh's DTensor norm reduced over its shards)."""
    norms = []
    for group in _by_mesh(grads) or [grads]:
        norm = _group_norm(group)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()


def _group_norm(group: list) -> torch.Tensor:
    """The 2-norm of one mesh's gradients. On a CPU, torch's float32 norm kernel accumulates with an
    error that grows with the tensor (7.6e-5 relative on the debug model's 577k-element output
    gradient, against 1e-7 on CUDA's tree reduction), which made one process's norm, and so its
    clipping, differ from the same batch's under FSDP (whose shards are summed apart); there the norms
    are taken in float64 and the total returned in the gradients' dtype. One foreach call, not a vector_norm per
    tensor: each of those is a parallel region of its own, and on a busy 2-core machine their 57 barriers took
    98 ms per debug-model step against 1.7 ms (4.1 against 3.8 ms on a quiet one)."""
    if group[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(group, foreach=True)
    norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64))
    return torch.linalg.vector_norm(norms).to(group[0].dtype)
