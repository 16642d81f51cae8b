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

import functools

import torch

from titanlite.errors import UserError
from titanlite.models.init import local_tensor

MAX_BETA2 = 0.99


def kahan_adamw_(
    tensors: list[torch.Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    decay_factor: float,
    step_size: float,
    bias_correction2: float,
) -> None:
    """The Kahan-compensated AdamW step of the module doc for one parameter, in place, fp32 arithmetic;
    `tensors`: the weight, its gradient, exp_avg, exp_avg_sq and the compensation."""
    weight, grad, exp_avg, exp_avg_sq, compensation = tensors
    grad = grad.float()
    m = exp_avg.float().lerp(grad, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + grad * grad * (1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = (v / bias_correction2).sqrt() + eps
    # Decoupled weight decay on the exact weight (weight + compensation), then the Adam step.
    target = (weight.float() + compensation.float()) * decay_factor - step_size * (m / denom)
    weight.copy_(target)
    compensation.copy_(target - weight.float())


@functools.cache
def compiled_update():
    """kahan_adamw_ as one fused (Triton) kernel per CUDA parameter: reads 5 and writes 4 bf16 tensors, no fp32
    temporaries in memory (eager or foreach ops write each intermediate out). dynamic=True: one graph serves
    every size; the floats change every step but are graph inputs, not constants. emulate_precision_casts:
    inductor otherwise folds float(bf16(target)) into target, and the compensation, target - float(weight),
    would come out 0. Compiled at the first CUDA step, not on import: torch.compile loads dynamo and its
    backends, half a second of start-up for runs with another optimizer."""
    return torch.compile(kahan_adamw_, fullgraph=True, dynamic=True, options={"emulate_precision_casts": True})


def fused_kahan_adamw_(*args) -> None:
    """kahan_adamw_ through compiled_update(); a compile that fails (no Triton) is one sentence."""
    try:
        compiled_update()(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # torch.compile has imported torch._dynamo
        raise UserError(
            f"optimizer.name AdamWBF16Kahan compiles its GPU update with torch.compile, which failed here "
            f"({type(e.inner_exception).__name__}); install Triton, or use optimizer.name AdamW"
        ) from e


class AdamWBF16Kahan(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def update_for(self, device: torch.device):
        """The compiled kernel on CUDA; op by op on the CPU, where the fused kernel's memory traffic matters little
        and torch 2.11's C++ inductor backend loses the compensation (on the GPU image's torch 2.11 the compiled
        CPU update trained exactly as plain bf16 AdamW, loss for loss)."""
        return fused_kahan_adamw_ if device.type == "cuda" else kahan_adamw_

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state(param)
                state["step"] += 1
                step = state["step"].item()
                tensors = [
                    local_tensor(t)
                    for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["compensation"])
                ]
                # Flat: one compiled graph serves every shape. detach: the result is no view, so dynamo
                # guards no base tensor's shape (which would recompile for every new one).
                flat = all(t.is_contiguous() for t in tensors)
                tensors = [(t.view(-1) if flat else t).detach() for t in tensors]
                self.update_for(param.device)(
                    tensors, beta1, beta2, eps, 1 - lr * decay, lr / (1 - beta1**step), 1 - beta2**step
                )
        return loss

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in ("exp_avg", "exp_avg_sq", "compensation"):
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state


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
    if cfg.implementation not in ("auto", "fused"):
        raise UserError(
            f"optimizer.implementation {cfg.implementation} does not exist for AdamWBF16Kahan (it updates each "
            "CUDA parameter with one compiled, fused kernel); set it to auto"
        )
    return AdamWBF16Kahan(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
