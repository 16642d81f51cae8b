"""AdamWBF16Kahan: AdamW's math, bf16 storage that tracks fp32, DTensor shards, and its refusals."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from titanlite.config_sections import Optimizer
from titanlite.errors import UserError
from titanlite.optim import build_optimizer
from titanlite.optim.bf16_adamw import AdamWBF16Kahan, fused_kahan_adamw_, kahan_adamw_


def regression(dtype, seed=0, device="cpu"):
    """A linear least-squares problem whose weights sit near 1, where bf16's resolution is coarse."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter((1 + 0.1 * torch.randn(32, 32, generator=generator)).to(device, dtype))
    inputs = torch.randn(256, 32, generator=generator).to(device)
    targets = inputs @ (1 + 0.1 * torch.randn(32, 32, generator=generator)).to(device)
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_with_kahan_tracks_fp32_where_plain_bf16_drifts(device):
    """Small steps (lr 1e-3 against weights near 1) mostly round away in plain bf16. CPU: the eager update;
    CUDA: the compiled kernel."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    w, x, y = regression(torch.float32, device=device)
    fp32 = train(w, x, y, torch.optim.AdamW([w], **kw), steps=150)
    w, x, y = regression(torch.bfloat16, device=device)
    kahan = train(w, x, y, AdamWBF16Kahan([w], **kw), steps=150)
    w, x, y = regression(torch.bfloat16, device=device)
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


class EagerKahan(AdamWBF16Kahan):
    """The same update run op by op, unfused, on any device: the oracle for the compiled kernel."""

    def update_for(self, device):
        return kahan_adamw_


class FusedKahan(AdamWBF16Kahan):
    """The compiled kernel on any device (the optimizer itself compiles it for CUDA parameters only)."""

    def update_for(self, device):
        return fused_kahan_adamw_


def test_the_cpu_update_is_eager_and_the_cuda_update_compiled():
    optimizer = AdamWBF16Kahan([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])
    assert optimizer.update_for(torch.device("cpu")) is kahan_adamw_
    assert optimizer.update_for(torch.device("cuda")) is fused_kahan_adamw_


@pytest.mark.cuda
def test_compiled_step_matches_the_eager_step():
    """The update the optimizer runs on CUDA, one Triton kernel per parameter shape, against the same math op
    by op. Fusion may contract a multiply-add or reorder an fp32 operation: each stored tensor may differ by
    one ulp of its dtype (finfo.eps relative), and weight + compensation, which a flipped bf16 rounding
    moves between its two parts, by fp32 rounding (1e-6 relative)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5), (1,)]
    runs = []
    device = "cuda"
    for optimizer_class in (FusedKahan, EagerKahan):
        params = [torch.nn.Parameter(torch.ones(shape, device=device).bfloat16()) for shape in shapes]
        params.append(torch.nn.Parameter(torch.ones(3, device=device)))  # an fp32 weight
        params.append(torch.nn.Parameter(torch.ones(4, 6, device=device).bfloat16().T))  # not contiguous: its own graph
        optimizer = optimizer_class(
            [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.1,
        )
        generator.manual_seed(0)
        for step in range(5):
            for i, p in enumerate(params):
                # The third parameter misses step 2: it counts one step fewer from then on.
                p.grad = None if (i == 2 and step == 2) else torch.randn(p.shape, generator=generator).to(p)
            optimizer.step()
        runs.append((params, optimizer.state))
    (ours, our_state), (eager, eager_state) = runs
    for p, q in zip(ours, eager):
        s, t = our_state[p], eager_state[q]
        assert s["step"] == t["step"] and p.dtype == q.dtype and s["compensation"].dtype == p.dtype
        assert s["exp_avg"].device.type == p.device.type == device
        ulp = torch.finfo(p.dtype).eps
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s[name], t[name], rtol=ulp, atol=0)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=ulp, atol=0)
        torch.testing.assert_close(
            p.float() + s["compensation"].float(), q.float() + t["compensation"].float(), rtol=1e-6, atol=0
        )


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
    with pytest.raises(UserError, match="optimizer.implementation foreach does not exist"):
        build_optimizer(model, Optimizer(name="AdamWBF16Kahan", implementation="foreach"), "cpu")
    assert isinstance(
        build_optimizer(model, Optimizer(name="AdamWBF16Kahan", implementation="fused"), "cpu"), AdamWBF16Kahan
    )
    assert isinstance(build_optimizer(model, Optimizer(name="AdamWBF16Kahan"), "cpu"), AdamWBF16Kahan)


def test_a_failing_compile_is_a_user_error(monkeypatch, tmp_path):
    """A compile that fails (here on CPU parameters, through FusedKahan, with no C++ compiler) names the
    optimizer and the fixes. float16 weights make a graph no other test compiled, and tmp_path an empty
    inductor cache, so the compile really runs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("/nonexistent/g++",))
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    weight.grad = torch.ones(4, dtype=torch.float16)
    with pytest.raises(
        UserError, match="AdamWBF16Kahan compiles its GPU update .*InvalidCxxCompiler.*optimizer.name AdamW"
    ):
        FusedKahan([weight]).step()
