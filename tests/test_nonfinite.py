"""training.on_nonfinite skip: a step whose loss or gradients hold NaN (injected from outside the package)
applies no update, is logged and counted, resume stays exact, and too many in a row stop the run."""

import shutil

import pytest
import torch
from conftest import logged_losses, tensorboard_scalars
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import titanlite.objectives.lm
from titanlite.train import main


class NanGradient(torch.autograd.Function):
    """The loss as it is, and NaN for every gradient behind it."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def inject(monkeypatch, at_calls: set[int], what: str):
    """Micro-batch losses (one per step here) at the given calls made NaN, or their gradients made NaN."""
    real, calls = titanlite.objectives.lm.micro_batch_loss, [0]

    def poisoned(*args, **kwargs):
        calls[0] += 1
        loss, extra = real(*args, **kwargs)
        if calls[0] not in at_calls:
            return loss, extra
        return (loss * float("nan") if what == "loss" else NanGradient.apply(loss)), extra

    monkeypatch.setattr(titanlite.objectives.lm, "micro_batch_loss", poisoned)


def state_at(dump, step, tmp_path):
    out = tmp_path / f"state-{step}.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k not in ("train_state", "dataloader", "rng")}


def flags(tiny_run, dump, steps):
    return [
        *tiny_run,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--training.on_nonfinite",
        "skip",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.last_save_model_only",
        "false",
        "--metrics.enable_tensorboard",
    ]


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_step_with_nan_gradients_is_skipped_and_resume_stays_exact(tiny_run, tmp_path, monkeypatch, capsys, device):
    """On CUDA the skip decision reads the device's flag before the optimizer step (a host sync)."""
    tiny_run = [*tiny_run, "--job.device", device, "--training.deterministic"]
    inject(monkeypatch, {3}, "gradient")
    assert main(flags(tiny_run, tmp_path / "whole", 6)) == 0
    err = capsys.readouterr().err
    assert "step 3: the loss or a gradient is NaN or inf; its update was skipped (1 in a row, 1 in this run)" in err
    # The weights, the optimizer's state and the lr schedule after step 3 are those after step 2.
    assert equal(state_at(tmp_path / "whole", 2, tmp_path), state_at(tmp_path / "whole", 3, tmp_path))
    assert not equal(state_at(tmp_path / "whole", 3, tmp_path), state_at(tmp_path / "whole", 4, tmp_path))
    assert tensorboard_scalars(tmp_path / "whole" / "tb", "training/skipped_steps") == {3: 1.0}

    # A run stopped after the skipped step resumes from its checkpoint exactly.
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    inject(monkeypatch, set(), "gradient")
    assert main(flags(tiny_run, tmp_path / "resumed", 6)) == 0
    resumed = capsys.readouterr().err.split("resumed from")[1]
    assert logged_losses(resumed) == {s: v for s, v in logged_losses(err).items() if s > 3}


@pytest.mark.parametrize("what", ["loss", "gradient"])
def test_too_many_skips_in_a_row_stop_the_run_in_one_sentence(tiny_run, tmp_path, monkeypatch, capsys, what):
    inject(monkeypatch, {2, 3}, what)
    assert main(flags(tiny_run, tmp_path, 6) + ["--training.max_nonfinite_skips", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "error: 2 steps in a row (up to step 3) had a NaN or inf loss or gradient and were skipped "
        "(training.max_nonfinite_skips 2)"
    ) in err
    assert "Traceback" not in err


def test_stop_is_the_default_and_catches_a_nan_gradient_behind_a_finite_loss(tiny_run, tmp_path, monkeypatch, capsys):
    inject(monkeypatch, {2}, "gradient")
    assert main([*tiny_run, "--job.dump_folder", str(tmp_path)]) == 2
    assert "the loss or the gradient norm became NaN or inf at step 2" in capsys.readouterr().err


def test_a_nan_at_the_first_step_blames_the_weights_not_the_learning_rate(tiny_run, tmp_path, monkeypatch, capsys):
    """No update has happened before step 1: lowering optimizer.lr could not help, so the sentence says so."""
    inject(monkeypatch, {1}, "loss")
    assert main([*tiny_run, "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is NaN or inf at step 1, the first of this run, before any update: the weights it started from" in err
    assert "optimizer.lr" not in err and "Traceback" not in err
