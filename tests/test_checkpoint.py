"""Checkpoints as a user meets them: resume, preemption, crashes, retention, mismatches, exports.

Exactness is checked bit for bit on the float32 losses TensorBoard records. A constant lr after
warmup (min_lr_factor 1) makes a run of N steps the start of any longer one, so every resumed
run is compared with the same uninterrupted reference.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import DEBUG_CONFIG, ON_CPU, ROOT, logged_losses, run_titanlite, tensorboard_scalars
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

from titanlite.train import main


def flags(folder: Path, steps: int, *extra, tb: str = "tb") -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(folder),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--metrics.save_tb_folder",
        tb,
        "--lr_scheduler.min_lr_factor",
        "1",
        *map(str, extra),
    ]


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    return out.stderr


def losses(folder: Path, tb: str = "tb") -> dict[int, float]:
    return tensorboard_scalars(folder / tb, "loss/train")


def steps_on_disk(folder: Path) -> list[str]:
    root = folder / "checkpoint"
    return sorted((p.name for p in root.iterdir()), key=lambda n: int(n.split("-")[1])) if root.is_dir() else []


def assert_same(reference: dict[int, float], resumed: dict[int, float], steps) -> None:
    assert sorted(resumed) == list(steps)
    assert {s: resumed[s] for s in steps} == {s: reference[s] for s in steps}  # bit for bit


@pytest.fixture(scope="module")
def reference_one(tmp_path_factory):
    """20 uninterrupted steps on one process."""
    folder = tmp_path_factory.mktemp("reference_one")
    ok(run_titanlite(flags(folder, 20)))
    return losses(folder)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory):
    """10 uninterrupted steps on two FSDP ranks."""
    folder = tmp_path_factory.mktemp("reference_two")
    ok(run_titanlite(flags(folder, 10), nproc=2))
    return losses(folder)


def start(args: list[str], log: Path, nproc: int = 0) -> subprocess.Popen:
    """Launch in the background, stderr into `log`."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    return subprocess.Popen(
        launcher + ["-m", "titanlite.train", *ON_CPU, *args], cwd=ROOT, stderr=log.open("w"), stdout=subprocess.DEVNULL
    )


def wait_for(log: Path, text: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None, f"ended before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{log.read_text()}"
        time.sleep(0.05)


def test_resume_one_process_sync_is_exact_keeps_k_and_skips_incomplete(tmp_path, reference_one):
    extra = ("--checkpoint.enable", "--checkpoint.interval", 2, "--checkpoint.keep_latest_k", 2)
    ok(run_titanlite(flags(tmp_path, 10, *extra)))
    assert steps_on_disk(tmp_path) == ["step-8", "step-10"]
    # A save that a crash cut short: data files, no .metadata (nor the checksums, which are written after it).
    shutil.copytree(tmp_path / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-12")
    (tmp_path / "checkpoint" / "step-12" / ".metadata").unlink()
    shutil.rmtree(tmp_path / "checkpoint" / "step-12" / "checksums")
    log = ok(run_titanlite(flags(tmp_path, 20, *extra, tb="tb2")))
    assert f"skipping {tmp_path / 'checkpoint' / 'step-12'}: it has no .metadata" in log
    assert f"resumed from {tmp_path / 'checkpoint' / 'step-10'} at step 10 (1,280 tokens seen)" in log
    assert_same(reference_one, losses(tmp_path, "tb2"), range(11, 21))
    assert steps_on_disk(tmp_path) == ["step-18", "step-20"]


def test_resume_one_process_from_an_async_save_is_exact(tmp_path, reference_one):
    extra = ("--checkpoint.enable", "--checkpoint.interval", 3, "--checkpoint.async_mode", "async")
    log = ok(run_titanlite(flags(tmp_path, 5, *extra)))
    assert "checkpoint step-3 saved in" in log and "(async saves, keeping all)" in log
    log = ok(run_titanlite(flags(tmp_path, 8, *extra, "--checkpoint.load_step", 3, tb="tb2")))
    assert "resumed from" in log and "at step 3" in log
    assert_same(reference_one, losses(tmp_path, "tb2"), range(4, 9))


def test_sigusr1_saves_exits_0_and_the_run_resumes_exactly(tmp_path, reference_one):
    extra = ("--checkpoint.enable", "--checkpoint.interval", 100)
    log = tmp_path / "first.log"
    process = start(flags(tmp_path, 14, *extra), log)
    wait_for(log, "step: 3 ", process)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=120) == 0, log.read_text()
    stopped = int(log.read_text().split("stopped at step ")[1].split()[0])
    assert f"stopped at step {stopped} on SIGUSR1; exiting" in log.read_text() and stopped < 14
    assert steps_on_disk(tmp_path) == [f"step-{stopped}"]
    ok(run_titanlite(flags(tmp_path, stopped + 3, *extra, tb="tb2")))
    assert_same(reference_one, losses(tmp_path, "tb2"), range(stopped + 1, stopped + 4))


def test_kill_9_during_async_saves_resumes_from_the_last_complete_checkpoint(tmp_path, reference_one):
    # A save every step, each slower than a step: a save is nearly always being written.
    extra = (
        "--checkpoint.enable",
        "--checkpoint.interval",
        1,
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.keep_latest_k",
        3,
    )
    log = tmp_path / "first.log"
    process = start(flags(tmp_path, 20, *extra), log)
    wait_for(log, "checkpoint step-5 saved", process)
    process.kill()
    process.wait()
    root = tmp_path / "checkpoint"
    complete = [int(p.name[5:]) for p in root.iterdir() if (p / ".metadata").is_file()]
    incomplete = [p for p in root.iterdir() if not (p / ".metadata").is_file()]
    newest = max(complete)
    assert newest >= 5
    out = ok(run_titanlite(flags(tmp_path, newest + 3, *extra, tb="tb2")))
    assert f"resumed from {root / f'step-{newest}'} at step {newest}" in out
    for folder in incomplete:
        assert f"skipping {folder}" in out
    assert_same(reference_one, losses(tmp_path, "tb2"), range(newest + 1, newest + 4))


def test_preempted_two_rank_run_resumes_exactly_then_on_one_rank(tmp_path, reference_two):
    """The acceptance run: torchrun, 2 FSDP ranks, async saves; SIGTERM to torchrun."""
    extra = ("--checkpoint.enable", "--checkpoint.interval", 2, "--checkpoint.async_mode", "async")
    log = tmp_path / "first.log"
    process = start(flags(tmp_path, 10, *extra), log, nproc=2)
    wait_for(log, "checkpoint step-2 saved", process, timeout=180)
    process.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    process.wait(timeout=120)  # torchrun itself reports the signal with exit code 1
    text = log.read_text()
    stopped = int(text.split("stopped at step ")[1].split()[0])
    assert f"stopped at step {stopped} on SIGTERM; exiting" in text and stopped < 10
    assert (tmp_path / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()

    ok(run_titanlite(flags(tmp_path, 10, *extra, tb="tb2"), nproc=2))
    assert_same(reference_two, losses(tmp_path, "tb2"), range(stopped + 1, 11))

    # The async save of step 2 on one process: DCP reshards model and optimizer; the data restarts.
    out = ok(run_titanlite(flags(tmp_path, 3, *extra, "--checkpoint.load_step", 2, tb="tb3")))
    assert "the data loader restarts its stream from the beginning: the data-parallel degree changed from 2 to 1" in out
    assert "at step 2" in out and sorted(logged_losses(out)) == [3]


def nan_step(out: subprocess.CompletedProcess) -> int:
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the loss or the gradient norm became NaN or inf at step "), out.stderr
    return int(line.split("at step ")[1].split(";")[0])


def test_nan_loss_stops_naming_the_step_and_saves_nothing_of_it(tmp_path):
    diverging = ("--checkpoint.enable", "--optimizer.lr", "1e6", "--training.max_norm", 0)
    bad_step = nan_step(run_titanlite(flags(tmp_path, 6, *diverging, "--checkpoint.interval", 1)))
    assert steps_on_disk(tmp_path) == [f"step-{s}" for s in range(1, bad_step)]
    # Steps neither logged nor saved are checked a step late; the error still names the first bad one
    # and the save of the step after it never happens.
    late = tmp_path / "late"
    run = flags(late, bad_step + 1, *diverging, "--checkpoint.interval", bad_step + 1, "--metrics.log_freq", 100)
    assert nan_step(run_titanlite(run)) == bad_step
    assert steps_on_disk(late) == []


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    ok(run_titanlite(flags(folder, 2, "--checkpoint.enable", "--checkpoint.interval", 2)))
    return folder / "checkpoint"


@pytest.mark.parametrize(
    "damage, extra, message",
    [
        (
            None,
            ["--model.name", "llama2"],
            "does not fit llama2/debugmodel (it was saved from llama3/debugmodel): layers.0.attention.wk.weight is "
            "128x256 there but 256x256 here",
        ),
        ("__0_0.distcp", [], "cannot be loaded"),
        (".metadata", [], "is corrupt: its .metadata cannot be read"),
    ],
    ids=["other-family", "corrupt-data", "corrupt-metadata"],
)
def test_a_checkpoint_that_does_not_fit_stops_with_one_sentence(
    tmp_path, small_checkpoint, damage, extra, message, capsys
):
    shutil.copytree(small_checkpoint, tmp_path / "checkpoint")
    folder = tmp_path / "checkpoint" / "step-2"
    if damage:  # DCP's own errors, as for a folder saved before checksums existed, loaded as the user allowed
        shutil.rmtree(folder / "checksums")
        extra = ["--checkpoint.allow_unverified", "true"]
        data = (folder / damage).read_bytes()
        (folder / damage).write_bytes(data[: len(data) // 2] + b"garbage")
    # In this process (main() is what the command exits with), sparing the suite a Python start-up.
    assert main(flags(tmp_path, 4, "--checkpoint.enable", *extra)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"error: checkpoint {folder} ") and message in lines[-1], lines
    assert not any(line.startswith("Traceback") for line in lines)


def test_seed_checkpoint_starts_a_run(tmp_path, reference_one):
    out = ok(run_titanlite(flags(tmp_path, 4, "--checkpoint.create_seed_checkpoint")))
    assert "checkpoint step-0 saved" in out and "step: 1 " not in out
    keys = FileSystemReader(str(tmp_path / "checkpoint" / "step-0")).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in keys and not any(k.startswith("optimizer") for k in keys)
    seed = tmp_path / "checkpoint" / "step-0"
    out = ok(run_titanlite(flags(tmp_path, 1, "--checkpoint.enable", tb="tb2")))  # found in its own folder
    assert f"loaded the model (weights only) from {seed}" in out
    assert losses(tmp_path, "tb2")[1] == reference_one[1]
    out = ok(run_titanlite(flags(tmp_path / "other", 1, "--checkpoint.initial_load_path", seed)))
    assert f"loaded the model (weights only) from {seed}" in out
    assert losses(tmp_path / "other")[1] == reference_one[1]


def saved_model(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=dtype) for k, m in metadata.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


@pytest.mark.extended
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bf16_exports_and_loading_the_hf_one_into_two_ranks(tmp_path):
    """Export model-only DCP and HF in bf16; load the HF folder on 2 FSDP ranks and, with lr 0,
    save the loaded weights in float32: they equal the exported bf16 values exactly."""
    export = tmp_path / "export"
    ok(
        run_titanlite(
            flags(
                export,
                4,
                "--checkpoint.enable",
                "--checkpoint.last_save_model_only",
                "--checkpoint.export_dtype",
                "bfloat16",
                "--checkpoint.last_save_in_hf",
            )
        )
    )
    dcp_folder, hf_folder = export / "checkpoint" / "step-4", export / "checkpoint" / "step-4-hf"
    metadata = FileSystemReader(str(dcp_folder)).read_metadata().state_dict_metadata
    assert {m.properties.dtype for m in metadata.values()} == {torch.bfloat16}
    assert json.loads((hf_folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(hf_folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16

    out = ok(
        run_titanlite(
            flags(
                tmp_path / "hf",
                1,
                "--optimizer.lr",
                0,
                "--checkpoint.enable",
                "--checkpoint.last_save_model_only",
                "--checkpoint.initial_load_path",
                hf_folder,
                "--checkpoint.initial_load_in_hf",
            ),
            nproc=2,
        )
    )
    assert f"loaded the model from the Hugging Face folder {hf_folder}" in out
    exported = saved_model(dcp_folder, torch.bfloat16)
    loaded = saved_model(tmp_path / "hf" / "checkpoint" / "step-1", torch.float32)
    assert loaded.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(loaded[name], tensor.float()), name
