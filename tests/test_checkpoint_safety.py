"""Issue 14: never lose or silently misuse a checkpoint. One test per case of the issue, each
asserting the sentence, the exit code, which steps are on disk afterwards and which step the next
run resumes from. Runs are in-process (titanlite.train.main) wherever the behaviour is; subprocesses
only where a signal's exit, a traceback or torchrun is the point.
"""

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, ROOT, run_titanlite

from titanlite.checkpoint.fit import holds_training_state, read_metadata
from titanlite.checkpoint.stopping import StopFlags
from titanlite.convert import main as convert_main
from titanlite.train import main as train_main

LLAMA = ["--model.name", "llama3", "--model.flavor", "debugmodel"]


def flags(folder: Path, steps: int, *extra) -> list[str]:
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
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        *map(str, extra),
    ]


def train(capsys, folder: Path, steps: int, *extra) -> tuple[int, str]:
    """One run in this process: (exit code, everything it printed)."""
    capsys.readouterr()
    code = train_main(flags(folder, steps, *extra))
    gc.enable()  # the trainer leaves gc off when a run stops with an error
    return code, capsys.readouterr().err


def live_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints of the live history."""
    root = folder / "checkpoint"
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / ".metadata").is_file())


def resumed_step(capsys, folder: Path) -> int:
    """The step a plain next run resumes from (run with training.steps 1: it resumes, trains nothing)."""
    code, out = train(capsys, folder, 1)
    assert code == 0, out
    assert "nothing to train" in out, out
    return int(out.split("resumed at step ")[1].split(",")[0])


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A dump folder with complete step-2, step-4 and step-6 checkpoints of llama3/debugmodel."""
    folder = tmp_path_factory.mktemp("history")
    assert train_main(flags(folder, 6)) == 0
    gc.enable()
    assert live_steps(folder) == [2, 4, 6]
    return folder


@pytest.fixture
def dump(history, tmp_path) -> Path:
    folder = tmp_path / "dump"
    shutil.copytree(history, folder)
    return folder


def test_1_rewind_with_retention_keeps_the_new_work(capsys, dump):
    code, out = train(capsys, dump, 5, "--checkpoint.load_step", 2, "--checkpoint.keep_latest_k", 1)
    assert code == 0, out
    assert "resuming from step 2: the newer step-4, step-6 belong to the abandoned history and were moved to" in out
    assert live_steps(dump) == [5]
    (aside,) = (dump / "checkpoint" / "abandoned").iterdir()
    assert aside.name.startswith("from-step-2-") and sorted(p.name for p in aside.iterdir()) == ["step-4", "step-6"]
    assert resumed_step(capsys, dump) == 5


def test_2_rewind_then_a_plain_resume_continues_the_new_history(capsys, dump):
    code, out = train(capsys, dump, 5, "--checkpoint.load_step", 2)
    assert code == 0, out
    assert live_steps(dump) == [2, 4, 5]
    assert resumed_step(capsys, dump) == 5


def test_3_convert_never_writes_over_a_checkpoint_unless_told(capsys, dump, tmp_path):
    step6, hf = dump / "checkpoint" / "step-6", tmp_path / "hf"
    assert convert_main(["dcp-to-hf", str(step6), str(hf), *LLAMA]) == 0
    assert convert_main(["dcp-to-hf", str(step6), str(hf), *LLAMA]) == 2
    assert (
        f"the destination {hf} already holds files; choose a new folder, or add --overwrite" in capsys.readouterr().err
    )
    assert convert_main(["hf-to-dcp", str(hf), str(step6), *LLAMA]) == 2
    assert (
        f"the destination {step6} already holds a complete DCP checkpoint; choose a new folder, or add --overwrite"
        in capsys.readouterr().err
    )
    assert holds_training_state(read_metadata(step6))  # untouched: still the full checkpoint
    assert resumed_step(capsys, dump) == 6
    assert convert_main(["hf-to-dcp", str(hf), str(step6), *LLAMA, "--overwrite"]) == 0
    assert not holds_training_state(read_metadata(step6))  # asked for: now the model alone


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_4_a_full_disk_stops_with_one_sentence_and_keeps_the_last_checkpoint(capsys, small_disk, mode):
    code, out = train(capsys, small_disk, 6, "--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", 1)
    assert code == 2, out
    root = small_disk / "checkpoint"
    assert f"error: checkpoint step-4 could not be written to {root}: no space left on the device; free at least" in out
    assert "it stopped without saving step 4, and the earlier checkpoints are untouched" in out
    # A sync save fails before step 5; an async one is found failed when its write ends, at the latest
    # at step 6's save, which first waits for it (how many steps train meanwhile depends on the load).
    assert "Traceback" not in out
    assert ("step: 5 " if mode == "disabled" else "checkpoint step-6 saved") not in out
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]  # the partial step-4 is gone
    assert resumed_step(capsys, small_disk) == 2


def test_5_folders_that_cannot_be_written_stop_the_run_before_training(capsys, tmp_path):
    (tmp_path / "checkpoint").write_text("not a folder")
    code, out = train(capsys, tmp_path, 4)
    assert code == 2
    assert out.strip() == (
        f"error: checkpoint.folder: {tmp_path / 'checkpoint'} cannot be a folder because "
        f"{tmp_path / 'checkpoint'} is a file; remove that file or choose another path"
    )
    code, out = train(capsys, tmp_path / "checkpoint" / "run", 4, "--checkpoint.enable", "false")
    assert code == 2 and "job.dump_folder" in out and "is a file" in out
    if os.geteuid() != 0:
        pytest.skip("the read-only case mounts a tmpfs, which needs root")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)]).returncode:
        pytest.skip("mount -t tmpfs -o ro failed")
    try:
        code, out = train(capsys, read_only, 4)
    finally:
        subprocess.run(["umount", str(read_only)], check=True)
    assert code == 2
    assert out.strip() == (
        f"error: job.dump_folder: {read_only} is not a writable folder (Read-only file system); "
        "fix its permissions or mount, or choose another path"
    )


def test_6_a_resume_refuses_another_model_and_stops_past_the_last_step(capsys, dump, tmp_path):
    code, out = train(capsys, dump, 8, "--model.name", "mistral")
    assert code == 2
    assert (
        f"error: checkpoint {dump / 'checkpoint' / 'step-6'} was saved from llama3/debugmodel, but this run is "
        "mistral/debugmodel; set model.name and model.flavor to llama3/debugmodel"
    ) in out
    weights_only = ("--model.name", "mistral", "--checkpoint.initial_load_path", dump / "checkpoint" / "step-6")
    code, out = train(capsys, tmp_path / "mistral", 1, *weights_only)  # asked for: the weights alone
    assert code == 0, out
    assert (
        f"loading the weights of llama3/debugmodel from {dump / 'checkpoint' / 'step-6'} into mistral/debugmodel" in out
    )
    code, out = train(capsys, dump, 4)
    assert code == 0
    assert "resumed at step 6, which is at or past training.steps 4: nothing to train; raise training.steps" in out
    assert "step:" not in out and live_steps(dump) == [2, 4, 6]


def send_when_handled(signum: int, delay: float = 0.0) -> threading.Thread:
    """Send `signum` to this process as soon as titanlite's handler for it is installed (+ delay)."""

    def send():
        while not isinstance(getattr(signal.getsignal(signum), "__self__", None), StopFlags):
            time.sleep(0.0005)
        time.sleep(delay)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def wait_for_line(log: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_7_signals_during_the_load_and_ctrl_c(capsys, dump, tmp_path):
    send_when_handled(signal.SIGTERM)  # the handler is installed just before the checkpoint load
    code, out = train(capsys, dump, 10)
    assert code == 0, out
    assert "SIGTERM came while loading; exiting at step 6 without training (nothing new to save)" in out
    assert live_steps(dump) == [2, 4, 6]

    fresh = tmp_path / "fresh"
    send_when_handled(signal.SIGINT, delay=1.0)  # the first Ctrl-C: stop at the step boundary and save
    code, out = train(capsys, fresh, 1000, "--checkpoint.interval", 1000)
    assert code == 0, out
    stopped = int(out.split("stopped at step ")[1].split(" on Ctrl-C; exiting")[0])
    assert live_steps(fresh) == [stopped] and resumed_step(capsys, fresh) == stopped

    twice = tmp_path / "twice"  # a second Ctrl-C exits at once: 130, no traceback, nothing more saved
    log = tmp_path / "twice.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "titanlite.train", *flags(twice, 1000, "--checkpoint.interval", 1000)],
        cwd=ROOT,
        stderr=log.open("w"),
        stdout=subprocess.DEVNULL,
    )
    wait_for_line(log, "step: 1 ", process)
    process.send_signal(signal.SIGINT)
    wait_for_line(log, "Ctrl-C again to exit at once", process)  # two signals sent at once would count as one
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 130
    said = log.read_text()
    assert "Ctrl-C: stopping at the end of this step, saving as on SIGTERM; Ctrl-C again to exit at once" in said
    assert "second Ctrl-C: exiting now without saving" in said and "Traceback" not in said
    assert live_steps(twice) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_8_a_missing_rank_times_out_naming_the_address_and_torchrun_adds_its_report(capsys, monkeypatch, tmp_path):
    port = free_port()
    for key, value in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    code, out = train(capsys, tmp_path, 4, "--job.init_timeout_seconds", 1)
    assert code == 2
    assert (
        f"error: the 2 ranks (WORLD_SIZE) did not meet at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} within "
        "job.init_timeout_seconds 1: 1 joined, 1 missing; start every RANK from 0 to 1"
    ) in out
    monkeypatch.setenv("RANK", "1")  # rank 0 is the one missing: this rank says so itself
    code, out = train(capsys, tmp_path, 4, "--job.init_timeout_seconds", 1)
    assert code == 2
    assert f"127.0.0.1:{port} within job.init_timeout_seconds 1: rank 1 could not reach rank 0 there;" in out
    monkeypatch.undo()

    # Under torchrun our sentence comes first; torchrun then adds its ChildFailedError report and exits 1.
    done = run_titanlite(flags(tmp_path, 0), nproc=1)
    assert done.returncode == 1
    ours = done.stderr.index("error: ")
    assert ours < done.stderr.index("ChildFailedError") and "exitcode  : 2" in done.stderr


def test_a_load_step_left_in_the_command_rewinds_once(capsys, dump):
    """Issue 42: a requeue with the same command (load_step 2 still in it) resumes the new history, instead of
    setting aside again the progress made since the rewind."""
    code, out = train(capsys, dump, 5, "--checkpoint.load_step", 2)
    assert code == 0 and "belong to the abandoned history" in out, out
    code, out = train(capsys, dump, 7, "--checkpoint.load_step", 2)
    assert code == 0, out
    assert "checkpoint.load_step 2 rewound this run once already" in out and "resumes from the newest checkpoint" in out
    assert "at step 5" in out and "abandoned history" not in out
    assert live_steps(dump) == [2, 4, 5, 6, 7]


def test_a_damaged_checkpoint_file_is_named_at_load(capsys, dump):
    """Issue 42: 400 bytes XORed in the middle of a .distcp file load unnoticed by DCP; the checksum each rank
    records at save names the file before anything is loaded."""
    shard = dump / "checkpoint" / "step-6" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 400] = bytes(b ^ 0x5A for b in data[middle : middle + 400])
    shard.write_bytes(bytes(data))
    code, out = train(capsys, dump, 8)
    assert code == 2, out
    assert f"checkpoint file {shard} does not match the checksum recorded when it was saved" in out
    assert "Traceback" not in out


def test_a_second_run_into_a_live_dump_folder_is_refused_and_a_dead_ones_lock_is_taken_over(capsys, dump):
    """Issue 42: one run per dump folder. A lock held by a live process (this one, as another run would) refuses
    the second run in one sentence; a lock whose process is gone is stale and taken over."""
    import json

    from titanlite.checkpoint.lock import LOCK

    lock = dump / LOCK
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "job": "", "started": "earlier"}))
    code, out = train(capsys, dump, 7)
    assert (
        code == 2
        and f"job.dump_folder {dump} is in use by another run (host {socket.gethostname()}, pid {os.getppid()}" in out
    )
    assert live_steps(dump) == [2, 4, 6]  # nothing written
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "job": "", "started": "earlier"})
    )
    code, out = train(capsys, dump, 7)
    assert code == 0 and "taking over the lock" in out and not lock.exists(), out
