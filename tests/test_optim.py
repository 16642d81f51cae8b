import pytest
import torch

from titanlite.config_sections import LRScheduler, Optimizer
from titanlite.optim import build_lr_scheduler, build_optimizer, lr_factor


def factors(steps, **kw):
    return [lr_factor(s, steps=steps, **kw) for s in range(1, steps + 1)]


def test_warmup_then_linear_decay_to_min():
    got = factors(6, warmup_steps=2, decay_type="linear", decay_ratio=-1, min_lr_factor=0.0)
    assert got == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_and_sqrt_shapes_end_at_min():
    cos = factors(5, warmup_steps=1, decay_type="cosine", decay_ratio=-1, min_lr_factor=0.1)
    assert cos == pytest.approx([1.0, 0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476), 0.55, 0.1 + 0.9 * 0.5 * (1 - 0.7071067811865476), 0.1])
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
