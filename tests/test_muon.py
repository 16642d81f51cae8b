"""Muon (titanlite/optim/muon.py): the Newton-Schulz iteration, which parameters it trains, FSDP2 against one process,
an exact resume, the planner's count of its state, and its refusals."""

import shutil
from dataclasses import replace

import pytest
import torch
from conftest import assert_planned_state, materialize, run_titanlite, tensorboard_scalars

from titanlite.config import load_config
from titanlite.config_sections import Optimizer
from titanlite.errors import UserError
from titanlite.models import get_model_args, get_model_spec
from titanlite.optim import build_optimizer
from titanlite.optim.muon import Muon, newton_schulz


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 32)], ids=["wide", "tall", "batched"])
def test_newton_schulz_makes_singular_values_near_one(shape):
    """Keller Jordan's quintic coefficients land every singular value in about [0.7, 1.2] after 5 steps."""
    update = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ortho = newton_schulz(update, 5, torch.float32)
    assert ortho.shape == update.shape
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular


def debug_model():
    args = replace(get_model_args(get_model_spec("llama3"), "debugmodel"), n_layers=1, vocab_size=128)
    return materialize("llama3", args)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = debug_model()
    optimizer = build_optimizer(model, Optimizer(name="Muon", muon_lr=0.02), "cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    muon, matrices, vectors = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert (
        all(n.startswith("layers.") and n.endswith(".weight") for n in muon) and "layers.0.attention.wq.weight" in muon
    )
    assert sorted(matrices) == ["output.weight", "tok_embeddings.weight"]
    assert "norm.weight" in vectors and all("norm" in n for n in vectors)
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 8e-4, 8e-4]


def test_its_adamw_half_is_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    theirs.load_state_dict(ours.state_dict())
    muon = Muon([{"params": list(ours.parameters()), "weight_decay": 0.1}], lr=1e-2)
    adamw = torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    x = torch.randn(16, 8)
    for _ in range(3):
        for model, optimizer in ((ours, muon), (theirs, adamw)):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer.muon_momentum", "0.9"], "optimizer.muon_momentum applies to optimizer.name Muon only"),
        (
            ["--optimizer.name", "Muon", "--optimizer.implementation", "fused"],
            "optimizer.implementation fused does not exist for Muon",
        ),
        (["--optimizer.name", "Muon", "--parallelism.fsdp_cpu_offload"], "set fsdp_cpu_offload false or use AdamW"),
    ],
)
def test_refusals(flags, message):
    with pytest.raises(UserError, match=message):
        load_config(flags)


def muon_run(folder, local_batch, steps=5, extra=()):
    return [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(folder),
        "--training.dataset",
        "synthetic",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        str(local_batch),
        "--training.global_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.name",
        "Muon",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted 1-process Muon run, 5 steps, saving at step 2 (its losses and its folder)."""
    folder = tmp_path_factory.mktemp("muon_one")
    flags = muon_run(folder, 4, extra=["--checkpoint.enable", "--checkpoint.interval", "2"])
    out = run_titanlite(flags)
    assert out.returncode == 0, out.stderr
    assert_planned_state(flags, 1, out.stderr)
    return tensorboard_scalars(folder / "tb", "loss/train"), folder


def test_fsdp_two_ranks_equal_one_process(tmp_path, one_process):
    single, _ = one_process
    flags = muon_run(tmp_path, 2)
    out = run_titanlite(flags, nproc=2)
    assert out.returncode == 0, out.stderr
    assert "mesh dp_replicate 1 x dp_shard 2" in out.stderr
    sharded = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert sorted(sharded) == sorted(single) == [1, 2, 3, 4, 5]
    for step in single:
        assert sharded[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), step
    assert_planned_state(flags, 2, out.stderr)  # one momentum buffer per block matrix, two moments for the rest


def test_resume_from_step_2_is_exact(tmp_path, one_process):
    single, folder = one_process
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(folder / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    out = run_titanlite(muon_run(tmp_path, 4, extra=["--checkpoint.enable", "--checkpoint.interval", "10"]))
    assert out.returncode == 0, out.stderr
    assert "at step 2" in out.stderr
    resumed = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert sorted(resumed) == [3, 4, 5]
    for step in resumed:
        assert resumed[step] == pytest.approx(single[step], rel=0, abs=1e-6), step
