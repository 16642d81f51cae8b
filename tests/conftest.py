"""Helpers to run titanlite as a user would: as a subprocess, alone or under torchrun."""

import json
import logging
import os
import re
import subprocess
from pathlib import Path

# Two xdist workers and the ranks they start share 2 cores: one thread per process, and inductor
# compiling in the process itself (its default on 2 cores is a pool of worker processes per
# compiling rank, each importing torch again). Set before torch is imported; every run started
# from a test inherits them.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist
from preloaded import run_python  # noqa: E402

from titanlite.models import get_model_args, get_model_spec

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
# Tests of CPU behaviour say so, so that the suite means the same on a GPU machine; args after it may override.
ON_CPU = ["--job.device", "cpu"]
HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier: wider or repeated checks of what the default tier checks more cheaply",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: runs the real GPU code paths; skipped (with the reason) without a CUDA GPU"
    )
    config.addinivalue_line(
        "markers",
        "extended: a wider or repeated check of a capability the default tier checks more "
        "cheaply (every layout, schedule, family or shipped config); run with --extended",
    )


def pytest_collection_modifyitems(config, items):
    """The default tier leaves the extended tests out (docs/testing.md: the 15-minute budget on 2 cores); the cuda
    tier is skipped, with its reason, where there is no GPU."""
    if not config.getoption("--extended"):
        extended = [item for item in items if item.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("cuda") and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def environment_restored():
    """A test that runs main() in-process may set variables for its run (the CUDA allocator setting,
    hidden GPUs); the next test, and the runs it starts, see the environment as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def titanlite_logger_fresh():
    """A test that runs main() in-process points titanlite's logger at its captured stderr and stops
    it propagating (so can a module-scoped fixture); every test starts from the logger as Python
    leaves it, propagating to the root logger (where caplog sees it)."""
    log = logging.getLogger("titanlite")
    for handler in log.handlers:
        handler.close()
    log.handlers[:], log.propagate, log.level = [], True, logging.NOTSET
    yield


def run_titanlite(
    args: list[str], nproc: int = 0, timeout: int = 300, env: dict | None = None, fresh_ranks: bool = False
) -> subprocess.CompletedProcess:
    """python -m titanlite.train (nproc 0) or torchrun --standalone with nproc processes, on the CPU
    unless args say --job.device cuda/auto: the command a user types, run by tests/preloaded.py (the
    launcher's own imports done once). torchrun's ranks are forked from that launcher
    (tests/forked_torchrun.py), or with fresh_ranks new interpreters, as from the command line: for tests
    whose subject is the launch (exit codes and torchrun's report, GPUs)."""
    if nproc and not fresh_ranks:
        launcher = [str(ROOT / "tests" / "forked_torchrun.py"), str(nproc)]
    elif nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        launcher = []
    return run_python(
        [*launcher, "-m", "titanlite.train", *ON_CPU, *args], str(ROOT), {**os.environ, **(env or {})}, timeout
    )


def with_root_on_path() -> dict:
    """This environment with the checkout first on PYTHONPATH, keeping what was there (packages a GPU image
    carries on PYTHONPATH, say): new interpreters import this titanlite, installed or not."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_test_script(script: str, *args: str, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """tests/<script> with args, alone (nproc 1) or under torchrun --standalone --nproc_per_node nproc with its
    ranks forked (tests/forked_torchrun.py), run by tests/preloaded.py: for runs whose subject is the numbers,
    not the launch."""
    launcher = [str(ROOT / "tests" / "forked_torchrun.py"), str(nproc)] if nproc > 1 else []
    return run_python([*launcher, str(ROOT / "tests" / script), *args], str(ROOT), with_root_on_path(), timeout)


def torchrun_json(script: str, tmp_path: Path, *args: str) -> dict:
    """Run tests/<script> on 2 forked torchrun ranks (run_test_script; the script's rank 0 writes JSON to the
    path it is given first, then `args`) and return that JSON."""
    out_file = tmp_path / "results.json"
    out = run_test_script(script, str(out_file), *args, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_file.read_text())


def logged_losses(output: str) -> dict[int, float]:
    """Training losses by step (not the "validate step: N  loss: x" lines)."""
    return {int(s): float(v) for s, v in re.findall(r"(?<!validate )step: (\d+)\s+loss: ([\d.]+)", output)}


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in folder.iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def assert_planned_state(args: list[str], world: int, output: str, keys=("params", "grads", "optimizer")) -> None:
    """The planner's per-rank parameter, gradient and optimizer bytes (built on a fake process group of
    `world` ranks) equal, byte for byte, what the trainer's run summary reports for the same flags."""
    from titanlite.config import load_config
    from titanlite.plan.job import plan_state

    measured = re.search(r"state_per_rank_bytes params (\d+) grads (\d+) optimizer (\d+)", output)
    assert measured, output
    planned = plan_state(load_config(args), world)
    reported = dict(zip(("params", "grads", "optimizer"), map(int, measured.groups())))
    assert {k: reported[k] for k in keys} == {k: planned[k] for k in keys}


@pytest.fixture
def tiny_run(tmp_path):
    """Flags for a very small, fast llama debug run writing into tmp_path."""
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "1",
    ]


def build_meta(name: str, flavor: str):
    """A registered flavor built on the meta device (sizes only, no memory)."""
    spec = get_model_spec(name)
    with torch.device("meta"):
        return spec.model_cls(get_model_args(spec, flavor))


def materialize(name: str, args, seed: int = 0):
    """The trainer's path: meta -> allocate -> NaN (nothing may stay uninitialised) -> init_weights."""
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    model.to_empty(device="cpu")
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data.fill_(float("nan"))
    model.init_weights(seed=seed)
    return model


def checkpointed_run(model, checkpoint, dump_folder, model_name: str = "linear", args=None, spec=None):
    """What CheckpointManager reads of build.py's Run, for a model a test built itself on one rank."""
    from types import SimpleNamespace

    from titanlite.config_sections import JobConfig

    cfg = JobConfig()
    cfg.checkpoint, cfg.job.dump_folder = checkpoint, str(dump_folder)
    return SimpleNamespace(
        cfg=cfg,
        model=model,
        label=model_name,
        args=args,
        tokenizer=SimpleNamespace(path=None),
        spec=SimpleNamespace(hf_adapter=spec.hf_adapter if spec else None),
        dims=SimpleNamespace(dp_rank=0, dp_degree=1),
    )


def checkpointed_training(optimizer, scheduler, dataloader):
    """build.py's Training around what a test built itself: a job alone (no replica groups), no metrics written."""
    from types import SimpleNamespace

    from titanlite.fault_tolerance import Alone
    from titanlite.run import Training

    alone = Alone()
    return Training(
        optimizer, scheduler, dataloader, steps=0, metrics=SimpleNamespace(write_scalars=None), replicas=alone
    )


@pytest.fixture
def world_of_one():
    """A one-rank gloo process group in this process (for CheckpointManager and other collectives)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def tmpfs(tmp_path):
    """A real 100 MiB tmpfs (root only): room for one 71 MB checkpoint of the debug model, not for two; a test may
    remount it read-only (root writes through a chmod-ed folder, not through that)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"mount -t tmpfs failed: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
