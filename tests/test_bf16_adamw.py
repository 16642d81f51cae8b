"""AdamWBF16Kahan: AdamW's math, bf16 storage that tracks fp32, DTensor shards, and its refusals."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from titanlite.bf16_adamw import AdamWBF16Kahan
from titanlite.config_sections import Optimizer
from titanlite.errors import UserError
from titanlite.models.init import local_tensor
from titanlite.optim import build_optimizer


def regression(dtype, seed=0):
    """A linear least-squares problem whose weights sit near 1, where bf16's resolution is coarse."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter((1 + 0.1 * torch.randn(32, 32, generator=generator)).to(dtype))
    inputs = torch.randn(256, 32, generator=generator)
    targets = inputs @ (1 + 0.1 * torch.randn(32, 32, generator=generator))
    return weight, inputs, targets


def train(weight, inputs, targets, optimizer, steps):
    losses = []
    for _ in range(steps):
        loss = ((inputs @ weight.float() - targets) ** 2).mean()  # fp32 math; the gradient lands in weight's dtype
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def test_on_fp32_weights_it_is_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    w1, x, y = regression(torch.float32)
    w2 = torch.nn.Parameter(w1.detach().clone())
    ours = train(w1, x, y, AdamWBF16Kahan([w1], **kw), steps=20)
    torch_adamw = train(w2, x, y, torch.optim.AdamW([w2], **kw), steps=20)
    torch.testing.assert_close(ours, torch_adamw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)


def test_bf16_with_kahan_tracks_fp32_where_plain_bf16_drifts():
    """Small steps (lr 1e-3 against weights near 1) mostly round away in plain bf16."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    w, x, y = regression(torch.float32)
    fp32 = train(w, x, y, torch.optim.AdamW([w], **kw), steps=150)
    w, x, y = regression(torch.bfloat16)
    kahan = train(w, x, y, AdamWBF16Kahan([w], **kw), steps=150)
    w, x, y = regression(torch.bfloat16)
    plain = train(w, x, y, torch.optim.AdamW([w], **kw), steps=150)
    kahan_gap = (kahan - fp32).abs().mean().item()
    plain_gap = (plain - fp32).abs().mean().item()
    assert fp32[-1] < 0.5 * fp32[0]  # it learns
    assert kahan_gap < 0.1 * plain_gap, (kahan_gap, plain_gap)
    assert (kahan[-1] - fp32[-1]).abs() < 0.01 * fp32[-1]


def test_states_are_bf16():
    w, x, y = regression(torch.bfloat16)
    optimizer = AdamWBF16Kahan([w], lr=1e-3)
    train(w, x, y, optimizer, steps=1)
    state = optimizer.state[w]
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "compensation")} == {torch.bfloat16}


class PerParameterKahan(AdamWBF16Kahan):
    """The step as it was before the foreach rewrite, one parameter at a time: the oracle."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update_one(param, group, self._count_step(param))

    def _update_one(self, param, group, step):
        state = self.state[param]
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        weight, compensation = local_tensor(param), local_tensor(state["compensation"])
        exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        grad = local_tensor(param.grad).float()
        m = exp_avg.float().lerp_(grad, 1 - beta1)
        v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
        target = weight.float() + compensation.float()
        target.mul_(1 - lr * decay).addcdiv_(m, denom, value=-lr / (1 - beta1**step))
        weight.copy_(target)
        compensation.copy_(target.sub_(weight.float()))


def test_foreach_step_equals_the_per_parameter_step_bit_for_bit():
    """Same fp32 operations in the same order (on CPU the foreach ops run them tensor by tensor; on
    CUDA fused foreach kernels may contract a multiply-add differently, by an fp32 ulp at most)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5), (1,)]
    runs = []
    for optimizer_class in (AdamWBF16Kahan, PerParameterKahan):
        params = [torch.nn.Parameter(torch.ones(shape).bfloat16()) for shape in shapes]
        params.append(torch.nn.Parameter(torch.ones(3)))  # an fp32 weight: its own foreach batch
        optimizer = optimizer_class([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}],
                                    lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        generator.manual_seed(0)
        for step in range(5):
            for i, p in enumerate(params):
                # The third parameter misses step 2: it counts one step fewer from then on.
                p.grad = None if (i == 2 and step == 2) else torch.randn(p.shape, generator=generator).to(p.dtype)
            optimizer.step()
        runs.append([p.detach().clone() for p in params] + [
            t.clone() for p in params for t in optimizer.state[p].values()])
    for ours, reference in zip(*runs):
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)


@pytest.fixture(scope="module")
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_fsdp_dtensor_params_step_like_plain_tensors(one_rank_mesh):
    plain_w, x, y = regression(torch.bfloat16)
    module = torch.nn.Linear(32, 32, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(plain_w)
    fully_shard(module, mesh=one_rank_mesh)
    assert isinstance(module.weight, DTensor)
    sharded = AdamWBF16Kahan(module.parameters(), lr=1e-3)
    plain = AdamWBF16Kahan([plain_w], lr=1e-3)
    inputs = x.bfloat16()
    for _ in range(3):
        ((module(inputs).float() - y) ** 2).mean().backward()
        ((inputs @ plain_w.T).float() - y).pow(2).mean().backward()
        for optimizer in (sharded, plain):
            optimizer.step()
            optimizer.zero_grad()
    assert isinstance(sharded.state[module.weight]["compensation"], DTensor)  # sharded and checkpointed like the weight
    torch.testing.assert_close(module.weight.full_tensor(), plain_w.detach(), rtol=0, atol=0)


def test_build_optimizer_refusals():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(UserError, match="set training.param_dtype bfloat16"):
        build_optimizer(model, Optimizer(name="AdamWBF16Kahan"), "cpu")
    model = model.to(torch.bfloat16)
    with pytest.raises(UserError, match="beta2 0.999"):
        build_optimizer(model, Optimizer(name="AdamWBF16Kahan", betas=[0.9, 0.999]), "cpu")
    with pytest.raises(UserError, match="optimizer.implementation fused does not exist"):
        build_optimizer(model, Optimizer(name="AdamWBF16Kahan", implementation="fused"), "cpu")
    assert isinstance(build_optimizer(model, Optimizer(name="AdamWBF16Kahan", implementation="foreach"), "cpu"), AdamWBF16Kahan)
    assert isinstance(build_optimizer(model, Optimizer(name="AdamWBF16Kahan"), "cpu"), AdamWBF16Kahan)
