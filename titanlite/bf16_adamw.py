"""AdamW for pure-bf16 training: weights and optimizer states in bf16, Kahan-compensated updates.

With training.param_dtype = "bfloat16" the model stores its weights in bf16; plain AdamW then
loses every update smaller than half a bf16 ulp of the weight (about 0.2% of it): late in training,
with small learning rates, or for norm gains near 1.0, most updates round away and the run drifts
from its fp32 twin. AdamWBF16Kahan keeps, per weight, a bf16 compensation buffer holding the
rounding error of the last update (the "AnyPrecision" idea, torchdistx's AnyPrecisionAdamW):

    target = weight + compensation + update     (in fp32)
    weight = bf16(target); compensation = bf16(target - weight)

so weight + compensation carries about 16 significant bits and the run tracks fp32 master
weights, while a parameter costs 10 bytes (bf16 weight, gradient, compensation and two moments)
instead of 16 (the same four in fp32, with no compensation). The arithmetic of each step is
fp32; only storage is bf16.

The moments are stored in bf16 too: an exponential average moves by (1 - beta) of the way each
step, so with beta2 above ~0.99 the second moment's steps fall below bf16's resolution and it can
no longer decay; build_optimizer refuses such betas.

Works on plain tensors and on FSDP2's DTensor shards alike: the states are created like the
parameter (so DTensor-sharded and checkpointed like it) and the update runs on local tensors.
"""

import torch

from titanlite.errors import UserError
from titanlite.models.init import local_tensor

MAX_BETA2 = 0.99


class AdamWBF16Kahan(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # One set of foreach kernels per device, dtype and step count (the bias corrections are
            # per step; parameters that missed a step count one fewer).
            batches: dict[tuple, list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    step = self._count_step(param)
                    batches.setdefault((param.device, param.dtype, step), []).append(param)
            for (_, _, step), params in batches.items():
                self._update(params, group, step)
        return loss

    def _count_step(self, param: torch.Tensor) -> float:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in ("exp_avg", "exp_avg_sq", "compensation"):
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        return state["step"].item()

    def _update(self, params: list[torch.Tensor], group: dict, step: float) -> None:
        """The Kahan-compensated AdamW step of the module doc for these parameters, fp32 arithmetic."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        weights = [local_tensor(p) for p in params]
        exp_avgs, exp_avg_sqs, compensations = (
            [local_tensor(s[name]) for s in states] for name in ("exp_avg", "exp_avg_sq", "compensation"))
        grads = [local_tensor(p.grad).float() for p in params]

        m = [t.float() for t in exp_avgs]  # .float() copies bf16 and aliases fp32: m and v are written
        v = [t.float() for t in exp_avg_sqs]  # back into the states below either way
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        torch._foreach_copy_(exp_avgs, m)
        torch._foreach_copy_(exp_avg_sqs, v)
        denom = torch._foreach_div(v, 1 - beta2**step)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        # weight + compensation in fp32, a new tensor even when the weight is fp32.
        target = torch._foreach_add([w.float() for w in weights], [c.float() for c in compensations])
        # Decoupled weight decay on the exact weight (weight + compensation), then the Adam step.
        torch._foreach_mul_(target, 1 - lr * decay)
        torch._foreach_addcdiv_(target, m, denom, value=-lr / (1 - beta1**step))
        torch._foreach_copy_(weights, target)
        torch._foreach_sub_(target, [w.float() for w in weights])
        torch._foreach_copy_(compensations, target)


def build_adamw_bf16_kahan(groups: list[dict], cfg) -> AdamWBF16Kahan:
    """From the [optimizer] section; refuses what it would not do well (see the module doc)."""
    dtypes = {p.dtype for group in groups for p in group["params"]}
    if dtypes != {torch.bfloat16}:
        raise UserError(
            "optimizer.name AdamWBF16Kahan updates bfloat16 weights; set training.param_dtype bfloat16 "
            "(and training.mixed_precision_param bfloat16)"
        )
    if cfg.betas[1] > MAX_BETA2:
        raise UserError(
            f"optimizer.betas: AdamWBF16Kahan stores the second moment in bfloat16, which cannot follow an average "
            f"with beta2 {cfg.betas[1]} (above {MAX_BETA2}); use e.g. 0.9,0.95"
        )
    if cfg.implementation not in ("auto", "foreach"):
        raise UserError(
            f"optimizer.implementation {cfg.implementation} does not exist for AdamWBF16Kahan (it updates all "
            "parameters with foreach kernels); set it to auto"
        )
    return AdamWBF16Kahan(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
