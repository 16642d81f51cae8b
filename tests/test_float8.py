"""Float8: every way it cannot run is one sentence; where torchao is installed, the conversion is real."""

import importlib.util
import sys
from dataclasses import replace

import pytest
import torch

from titanlite.config_sections import Float8
from titanlite.errors import UserError
from titanlite.parallel import float8
from titanlite.parallel.float8 import check_float8

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_cli_on_cpu_exits_2_with_one_line(tiny_run):
    from conftest import run_titanlite

    out = run_titanlite(tiny_run + ["--float8.enable", "--float8.recipe_name", "rowwise"])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        "error: float8.enable needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        "this run is on CPU: set float8.enable false"
    ), out.stderr


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend to be on a CUDA device of the given compute capability."""

    def on(capability, name="Fake GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)

    return on


def test_gpu_without_float8_is_refused(fake_gpu):
    fake_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as error:
        check_float8(Float8(enable=True))
    assert str(error.value) == (
        "float8.enable needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); NVIDIA A100-SXM4-80GB has 8.0: "
        "set float8.enable false"
    )


def test_missing_torchao_is_one_sentence(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` raise ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"float8.enable needs torchao, which is not installed: pip install torchao"):
        check_float8(Float8(enable=True))


@pytest.mark.parametrize(
    "cfg, message",
    [
        (Float8(enable=True, recipe_name="rowwise", enable_fsdp_float8_all_gather=True), "tensorwise only"),
        (
            Float8(enable=True, precompute_float8_dynamic_scale_for_fsdp=True),
            "needs float8.enable_fsdp_float8_all_gather",
        ),
    ],
)
def test_options_that_do_not_go_together(fake_gpu, cfg, message):
    fake_gpu((9, 0))
    with pytest.raises(UserError, match=message):
        check_float8(cfg)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao (the float8 extra) is not installed")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_the_block_linears_only(recipe):
    """torchao's real conversion, run in emulation (no float8 kernels on CPU): the blocks' Linears
    become Float8Linear, the output layer (filter_fqns) stays, and the model still trains."""
    from torchao.float8.float8_linear import Float8Linear

    from titanlite.models.llama.args import LLAMA3_FLAVORS
    from titanlite.models.llama.model import Transformer

    args = replace(LLAMA3_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    keys = list(model.state_dict())
    float8.convert_linears(model, Float8(enable=True, recipe_name=recipe), emulate=True)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == 7 * args.n_layers and "output" not in converted
    assert list(model.state_dict()) == keys
    tokens = torch.randint(0, 128, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and model.layers["0"].attention.wq.weight.grad is not None


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao (the float8 extra) is not installed")
def test_scale_precompute_runs_after_each_optimizer_step(monkeypatch):
    import torchao.float8

    calls = []
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", calls.append)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = Float8(enable=True, enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
    float8.register_float8_scale_precompute(optimizer, model, cfg)
    float8.register_float8_scale_precompute(optimizer, model, Float8(enable=True))  # not asked: no hook
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    optimizer.step()
    assert calls == [model, model]
