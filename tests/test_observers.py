"""Observers never stop training (titanlite/metrics/observers.py): a failure injected into each of them (from
outside the package, through monkeypatch) is logged once, that observer turns itself off, and the run
finishes with exactly the weights of an untouched run; and the save-cost accounting of a save every
step, which once crashed a run at about step 38, reports every save."""

import contextlib
import io
import math

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU, logged_losses
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.tensorboard import SummaryWriter

from titanlite.checkpoint.cost import SaveCost
from titanlite.train import main


def raises(*_args, **_kwargs):
    raise RuntimeError("injected failure")


def final_weights(dump, tmp_path):
    torch_file = tmp_path / "final.pt"
    dcp_to_torch_save(dump / "checkpoint" / "step-6", torch_file)
    return torch.load(torch_file, weights_only=False)


def observed_run(dump) -> list[str]:
    """Flags of a 6-step run with every observer on: async saves every 2 steps, TensorBoard, traces."""
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--training.steps",
        "6",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.last_save_model_only",
        "--metrics.enable_tensorboard",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "3",
    ]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """(its log, its final weights): the untouched run every injected one is compared with."""
    dump = tmp_path_factory.mktemp("clean")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the logger's handler is made inside, on this stream
        assert main(observed_run(dump)) == 0
    return err.getvalue(), final_weights(dump, dump)


INJECTIONS = {
    "save-cost accounting": ("titanlite.checkpoint.cost.SaveCost._clean_steps", True),
    "metrics": ("titanlite.metrics.memory_usage", False),
    "TensorBoard": (SummaryWriter, "add_scalar"),
    "profiling": ("titanlite.metrics.profiling.StepProfiler._save_trace", True),
    "run summary": ("titanlite.metrics.profiling.peak_memory_gib", True),
    "the planner's start-up prediction": ("titanlite.train.predict_on_gpu", True),
}


# Two observers in the default tier (one that draws the loss lines, one that does not), the rest in the extended.
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=() if name in ("metrics", "profiling") else pytest.mark.extended) for name in INJECTIONS],
)
def test_a_failing_observer_turns_itself_off_and_training_goes_on(name, clean_run, tmp_path, monkeypatch, capsys):
    clean, clean_weights = clean_run
    target = INJECTIONS[name]
    if isinstance(target[0], type):
        monkeypatch.setattr(*target, raises)
    else:
        monkeypatch.setattr(target[0], raises)
    assert main(observed_run(tmp_path / "injected")) == 0
    err = capsys.readouterr().err
    assert (
        err.count(
            f"{name} failed and is turned off for the rest of the run; training goes on (RuntimeError: injected failure"
        )
        == 1
    ), err
    assert "training finished after 6 steps" in err
    if target[1]:  # the loss lines are still printed: the same losses
        assert logged_losses(err) == logged_losses(clean) and len(logged_losses(err)) == 6
    injected_weights = final_weights(tmp_path / "injected", tmp_path)
    assert clean_weights.keys() == injected_weights.keys()
    assert all(torch.equal(clean_weights[k], injected_weights[k]) for k in clean_weights)


def test_saves_every_step_are_all_reported():
    """40 saves, one per step, each writing while the next step runs: with no untouched step after any
    of them, the bounded history of finished saves dropped saves still waiting to be reported, and the
    share of a step they touched divided by zero (ZeroDivisionError at about step 38 of a real run)."""
    reported = {}
    cost = SaveCost(
        lambda step, values: reported.update({step: values["checkpoint/training_lost_seconds"]}), warmup_steps=2
    )
    for step in range(1, 41):
        began = float(step)
        if step > 1:  # the previous step's save wrote during the first half of this step
            cost.save_finished(step - 1, started=began - 0.1, done_at=began + 0.5, blocked=0.01)
        cost.step_done(began, began + 1.0)
    cost.save_finished(40, started=40.9, done_at=41.0, blocked=0.01)
    cost.flush()
    assert "_observers_off" not in cost.__dict__ or not cost._observers_off
    assert sorted(reported) == list(range(1, 41)) and cost.saves == 40
    assert all(math.isfinite(lost) for lost in reported.values())
