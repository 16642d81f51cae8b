import pytest
import torch

from titanlite.config_sections import LRScheduler, Optimizer
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_factor


def factors(steps, **kw):
    return [lr_factor(s, steps=steps, **kw) for s in range(1, steps + 1)]


def test_warmup_then_linear_decay_to_min():
    got = factors(6, warmup_steps=2, decay_type="linear", decay_ratio=-1, min_lr_factor=0.0)
    assert got == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_and_sqrt_shapes_end_at_min():
    cos = factors(5, warmup_steps=1, decay_type="cosine", decay_ratio=-1, min_lr_factor=0.1)
    assert cos == pytest.approx(
        [1.0, 0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476), 0.55, 0.1 + 0.9 * 0.5 * (1 - 0.7071067811865476), 0.1]
    )
    sqrt = factors(5, warmup_steps=1, decay_type="sqrt", decay_ratio=-1, min_lr_factor=0.0)
    assert sqrt == pytest.approx([1.0, 0.5, 1 - 0.5**0.5, 1 - 0.75**0.5, 0.0])


def test_warmup_stable_decay():
    got = factors(10, warmup_steps=2, decay_type="linear", decay_ratio=0.25, min_lr_factor=0.0)
    # 8 steps after warmup, the last 2 decay.
    assert got == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 1, 0.5, 0.0])


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2, decay_type="linear", min_lr_factor=0.0), steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 2.0, 1.0, 0.0])


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, Optimizer(weight_decay=0.1), "cpu")
    decayed, plain = opt.param_groups
    assert [p.dim() for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0


def test_gradient_norm_on_cpu_is_the_float64_norm():
    """torch's float32 norm kernel on a CPU drifts with the tensor's size (7.6e-5 relative on the debug
    model's output gradient), which made one process's clipping differ from FSDP's; the trainer's norm
    equals the float64 one to float32 precision."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((2256, 256), (256,), (256, 768))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    norm = clip_grad_norm_(params, max_norm=0.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(exact, rel=2e-7)
