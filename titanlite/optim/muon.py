"""Muon: orthogonalized momentum for the matrices inside the blocks, AdamW for everything else.

For a block's weight W (A x B) with gradient G, each step (Keller Jordan, "Muon: An optimizer for
hidden layers in neural networks", 2024; the momentum and Nesterov form of his reference code):

    M = mu * M + G                        (momentum buffer, one per matrix)
    U = G + mu * M   (nesterov)   or  U = M
    O = NS5(U)                            (the nearest semi-orthogonal matrix, approximately)
    W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O

NS5 is his quintic Newton-Schulz iteration: X = U / ||U||_F (transposed so that A <= B), then
`ns_steps` (5) times X = a X + (b X X^T + c (X X^T)^2) X with (a, b, c) = (3.4445, -4.7750, 2.0315),
coefficients chosen to push every singular value into about [0.7, 1.2] in few steps rather than to
converge to exactly 1. It runs in optimizer.muon_ns_dtype (float32 by default, exact across layouts;
bfloat16 as in the reference code is faster on GPUs).

The shape scale 0.2 * sqrt(max(A, B)) is Moonshot's ("Muon is Scalable for LLM Training", Liu et al.
2025, eq. 4): an orthogonal A x B matrix has RMS sqrt(1 / max(A, B)), so the update's RMS becomes 0.2,
about AdamW's. We chose it over Keller Jordan's max(1, A/B)^0.5 because with it the AdamW learning rate,
weight decay and schedule carry over unchanged to the Muon matrices, so one optimizer.lr serves both
halves (optimizer.muon_lr can still set the matrices' own). Weight decay is decoupled and applies to the
matrices, as Moonshot found necessary at scale. Tensors with more than two dimensions (grouped MoE
experts) are a batch of matrices, each orthogonalized on its own.

Sharding: NS5 needs the whole matrix. Under FSDP2 (and TP) every rank gathers each matrix's update
(DTensor.full_tensor), runs NS5 on it, and keeps its own shard of the result: the same arithmetic as
one process on every rank, at the price of an all-gather per matrix and redundant NS5 work (the
distributed versions that assign matrices to ranks save that work but need a scatter back; the
all-gather is the simpler exact choice at titanlite's sizes). Momentum and AdamW moments are
elementwise and stay sharded like their parameter, so they checkpoint like it.
"""

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from titanlite.dtypes import DTYPES
from titanlite.models.init import local_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
UPDATE_RMS = 0.2  # Moonshot's match to AdamW's update RMS


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """NS5 of the module doc on the last two dimensions, in `dtype`, returned in update's dtype."""
    x = update.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT  # X X^T is then the smaller Gram matrix
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(update.dtype)


def shape_scale(shape: torch.Size) -> float:
    return UPDATE_RMS * math.sqrt(max(shape[-2], shape[-1]))


def whole(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full matrix of which `local` is this rank's shard laid out like `param` (a collective under DTensor)."""
    if not isinstance(param, DTensor):
        return local
    sharded = DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )
    return sharded.full_tensor()


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full`, laid out like `param`: every rank holds `full`, so redistributing from
    Replicate only slices, with no communication."""
    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


class Muon(torch.optim.Optimizer):
    """One optimizer (one state dict, one lr schedule) over two kinds of group: those with muon=True step
    as in the module doc, the others as torch's AdamW (decoupled decay, bias-corrected moments)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "float32",
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        defaults = dict(
            lr=lr,
            muon=False,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    (self._muon_step if group["muon"] else self._adamw_step)(param, group)
        return loss

    def _muon_step(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        grad, buf = local_tensor(param.grad), local_tensor(state["momentum_buffer"])
        mu = group["momentum"]
        buf.mul_(mu).add_(grad)
        update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        ortho = newton_schulz(whole(update, param), group["ns_steps"], DTYPES[group["ns_dtype"]])
        weight, lr = local_tensor(param), group["lr"]
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(shard_like(ortho, param), alpha=-lr * shape_scale(param.shape))

    def _adamw_step(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"].item()
        (beta1, beta2), lr = group["betas"], group["lr"]
        grad, weight = local_tensor(param.grad), local_tensor(param)
        m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        weight.mul_(1 - lr * group["weight_decay"])
        denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        weight.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def muon_trains(name: str, param: torch.Tensor) -> bool:
    """Muon trains the matrices (and batches of matrices) of the transformer blocks, model.layers, and of
    DeepSeek-V3's multi-token-prediction depths, model.mtp (a block and a projection each), by their FQN."""
    parts = name.split(".")
    return param.dim() >= 2 and ("layers" in parts or "mtp" in parts)


def build_muon(model: torch.nn.Module, cfg) -> Muon:
    """Muon for the blocks' matrices, AdamW for embeddings, norms, biases and the output layer (decay on
    matrices only, as build_optimizer does for AdamW), from the [optimizer] section."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if muon_trains(n, p)]
    chosen = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in chosen]
    groups = [
        {"params": muon, "muon": True, "lr": cfg.muon_lr if cfg.muon_lr >= 0 else cfg.lr},
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    return Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        ns_dtype=cfg.muon_ns_dtype,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
