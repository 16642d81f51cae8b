"""Issue 53: the dump-folder lock under many simultaneous takers, and on a folder that turns read-only.

The takers are forked processes released together by a barrier; each stays alive until all have tried, so a
lock taken is the lock of a live run for every other taker.
"""

import gc
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEBUG_CONFIG, ON_CPU
from titanlite.checkpoint.lock import LOCK, take_lock
from titanlite.errors import UserError
from titanlite.train import main as train_main

TAKERS = 32  # processes
FOLDERS = 50  # folders each process tries in turn: 50 races per batch of processes (3 in 20 failed before the fix)


def try_lock(folder: Path) -> tuple[str, object]:
    try:
        take_lock(folder)
        return "took", os.getpid()
    except UserError as error:
        return "refused", str(error)
    except BaseException as error:  # what the issue saw: FileNotFoundError from the shared .partial file
        return "crashed", repr(error)


def taker(folders: list[Path], start, done, results) -> None:
    start.wait()
    results.put([try_lock(folder) for folder in folders])
    results.close()
    results.join_thread()  # sent before os._exit, which skips the queue's own flush at exit
    done.wait()  # alive until every taker has tried: the winner's lock is a live run's
    os._exit(0)


def race(folders: list[Path]) -> list[list[tuple[str, object]]]:
    """TAKERS processes, released together, call take_lock on each folder in turn; what each got, by folder."""
    fork = multiprocessing.get_context("fork")
    start, done, results = fork.Barrier(TAKERS), fork.Barrier(TAKERS), fork.Queue()
    processes = [fork.Process(target=taker, args=(folders, start, done, results)) for _ in range(TAKERS)]
    for process in processes:
        process.start()
    by_process = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(60)
    return [list(outcomes) for outcomes in zip(*by_process)]


def assert_one_winner(folder: Path, outcomes: list) -> None:
    kinds = [kind for kind, _ in outcomes]
    assert kinds.count("took") == 1 and kinds.count("refused") == TAKERS - 1, (folder, outcomes)
    (winner,) = [pid for kind, pid in outcomes if kind == "took"]
    assert json.loads((folder / LOCK).read_text())["pid"] == winner
    for _, said in (o for o in outcomes if o[0] == "refused"):
        assert said.startswith(f"job.dump_folder {folder} is in use by another run (host ") and "give this run another" in said
    assert sorted(p.name for p in folder.iterdir()) == [LOCK]  # no stray partial files


def folders(root: Path) -> list[Path]:
    made = [root / f"run{i}" for i in range(FOLDERS)]
    for folder in made:
        folder.mkdir()
    return made


def test_exactly_one_of_many_simultaneous_takers_gets_a_free_folder(tmp_path):
    raced = folders(tmp_path)
    for folder, outcomes in zip(raced, race(raced)):
        assert_one_winner(folder, outcomes)


def test_exactly_one_of_many_simultaneous_takers_takes_over_a_stale_lock(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "job": "", "started": "earlier"})
    raced = folders(tmp_path)
    for folder in raced:
        (folder / LOCK).write_text(stale)
    for folder, outcomes in zip(raced, race(raced)):
        assert_one_winner(folder, outcomes)


def remount_read_only_when(path: Path, mount: Path) -> threading.Thread:
    """Remount `mount` read-only as soon as `path` exists (the run's config.toml: written after the lock is taken)."""

    def remount():
        deadline = time.monotonic() + 120
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)

    thread = threading.Thread(target=remount, daemon=True)
    thread.start()
    return thread


def test_a_dump_folder_turned_read_only_ends_in_the_save_sentence_not_the_locks_traceback(capsys, tmpfs):
    """The save's sentence, exit 2: the lock that cannot be removed at exit no longer raises over it."""
    remounting = remount_read_only_when(tmpfs / "config.toml", tmpfs)
    capsys.readouterr()
    code = train_main([*ON_CPU, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmpfs), "--training.seq_len", "64",
                       "--training.local_batch_size", "2", "--training.steps", "4", "--checkpoint.enable", "true",
                       "--checkpoint.interval", "2"])
    gc.enable()  # the trainer leaves gc off when a run stops with an error
    remounting.join()
    out = capsys.readouterr().err
    assert code == 2, out
    assert "Traceback" not in out
    assert (f"error: checkpoint step-2 could not be written to {tmpfs / 'checkpoint'}: the filesystem is read-only; make it "
            "writable") in out
    assert f"the lock {tmpfs / LOCK} could not be removed (Read-only file system); the next run takes it over as stale" in out
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert json.loads((tmpfs / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match="is in use by another run"):  # this process (the dead run's stand-in) lives
        take_lock(tmpfs)
