"""Issue 53: the dump-folder lock under many simultaneous takers, and on a folder that turns read-only.

The takers are forked processes released together by a barrier; each stays alive until all have tried, so a
lock taken is the lock of a live run for every other taker.
"""

import gc
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, ROOT, with_root_on_path

from titanlite.checkpoint.lock import LOCK, RESTART_POLL, STALE, job_id, machine, process_start, take_lock
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
        assert (
            said.startswith(f"job.dump_folder {folder} is in use by another run (host ")
            and "give this run another" in said
        )
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
    code = train_main(
        [
            *ON_CPU,
            "--job.config_file",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(tmpfs),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "4",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
        ]
    )
    gc.enable()  # the trainer leaves gc off when a run stops with an error
    remounting.join()
    out = capsys.readouterr().err
    assert code == 2, out
    assert "Traceback" not in out
    assert (
        f"error: checkpoint step-2 could not be written to {tmpfs / 'checkpoint'}: the filesystem is read-only; make "
        "it "
        "writable"
    ) in out
    assert (
        f"the lock {tmpfs / LOCK} could not be removed (Read-only file system); the next run takes it over as stale"
        in out
    )
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert json.loads((tmpfs / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match="is in use by another run"):  # this process (the dead run's stand-in) lives
        take_lock(tmpfs)


# Issue 61: two jobs are told apart by their processes first, and by a job id only where no other job can share it.


def holder_record(**fields) -> str:
    return json.dumps(
        {
            "host": "elsewhere",
            "pid": 4242,
            "machine": "another-boot pid:[1]",
            "pid_start": "1",
            "job": "",
            "started": "earlier",
        }
        | fields
    )


def lock_aged(folder: Path, record: str, seconds: float) -> None:
    (folder / LOCK).write_text(record)
    then = time.time() - seconds
    os.utime(folder / LOCK, (then, then))


@pytest.fixture
def sleeper():
    """A live process of this machine (the lock's holder in a test), and its start time as /proc gives it."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process.pid, process_start(process.pid)
    process.kill()
    process.wait()


def test_job_ids_count_only_where_no_other_job_shares_them(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    assert job_id() == ""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert job_id() == "slurm 77.batch"
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert job_id() == "slurm 77.3"
    monkeypatch.setenv(
        "TORCHELASTIC_RUN_ID", "none"
    )  # torchrun without --rdzv-id: every job's, inside one allocation too
    assert job_id() == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5d0c6f7e")  # --standalone's uuid, or the --rdzv-id given
    assert job_id() == "torchrun 5d0c6f7e"


def test_a_live_process_of_this_machine_keeps_its_lock_whatever_its_job_and_age(tmp_path, monkeypatch, sleeper):
    """The issue's two torchrun jobs (run id "none" for both) reduced to the record: the holder's process is alive here,
    so the lock is its own even with this job's id and 10 minutes without a touch; a later process under its pid
    (another start time) is not it."""
    pid, started = sleeper
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "same-job")
    live = holder_record(
        host=socket.gethostname(), pid=pid, machine=machine(), pid_start=started, job="torchrun same-job"
    )
    lock_aged(tmp_path, live, 600)
    with pytest.raises(UserError) as refused:
        take_lock(tmp_path)
    assert str(refused.value) == (
        f"job.dump_folder {tmp_path} is in use by another run (host {socket.gethostname()}, pid {pid}, job torchrun "
        "same-job, started earlier): two runs in one folder would overwrite each other's checkpoints; give this run "
        "another job.dump_folder, or stop that run first (a lock is never taken from a live process on its machine)"
    )
    assert (tmp_path / LOCK).read_text() == live
    lock_aged(tmp_path, holder_record(host=socket.gethostname(), pid=pid, machine=machine(), pid_start="1"), 0)
    take_lock(tmp_path)  # that pid is a later process's: the holder is gone
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()


def test_a_lock_taken_on_another_machine_is_this_jobs_only_by_an_id_no_other_job_shares(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    for ours, theirs, taken in (
        ("none", "", False),
        ("job-a", "torchrun job-b", False),
        ("job-a", "torchrun job-a", True),
    ):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", ours)
        lock_aged(tmp_path, holder_record(job=theirs), 5)
        if taken:
            take_lock(tmp_path)
            assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
            assert "it belongs to this job (torchrun job-a), restarted" in caplog.text
        else:
            with pytest.raises(
                UserError,
                match=r"in use by another run \(host elsewhere, pid 4242, job "
                r".*or stop that run \(its lock .* is taken over once 120 s old\)",
            ):
                take_lock(tmp_path)


def test_a_restarted_job_without_an_id_waits_for_its_old_lock_to_go_stale(tmp_path, monkeypatch, caplog):
    """torchrun --max-restarts without --rdzv-id: rank 0 restarted on another machine cannot tell its old lock from
    another job's; the old one stops being touched, so it waits until the lock is STALE seconds old and takes it."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    caplog.set_level("INFO")
    lock_aged(tmp_path, holder_record(), STALE - 1)
    began = time.monotonic()
    take_lock(tmp_path)
    assert 1 <= time.monotonic() - began < 2 * RESTART_POLL
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "by a job without an id, perhaps this job before its restart: waiting up to 150 s" in caplog.text
    assert "taking over the lock" in caplog.text and "it was last touched" in caplog.text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_job(dump: Path, steps: int, log: Path) -> subprocess.Popen:
    """One rank of the debug model under torchrun as a multi-node job is started (docs/parallelism.md), without
    --standalone: a c10d rendezvous of its own, and torchrun's run id "none", as every such job's."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{free_port()}",
        "-m",
        "titanlite.train",
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--model.n_layers",
        "1",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(dump),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "100000",
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=with_root_on_path() | {"OMP_NUM_THREADS": "1"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the lock (whose heartbeat touches it), by path."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK
    }


def test_two_torchrun_jobs_without_standalone_do_not_share_a_dump_folder(tmp_path):
    """Issue 61: torchrun names both jobs "none", which the lock took for one job restarted, and the second took the
    first's live lock. Now the second refuses in one sentence (its rank exits 2) and leaves the first's files as they
    were; the first trains on and, stopped by SIGTERM, saves its step and gives the folder back."""
    dump, first_log, second_log = tmp_path / "run", tmp_path / "first.log", tmp_path / "second.log"
    first = torchrun_job(dump, 100000, first_log)
    try:
        deadline = time.monotonic() + 180
        while "step: 2  loss" not in first_log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-3000:]
            time.sleep(0.2)
        before, lock = contents(dump), (dump / LOCK).read_text()
        second = torchrun_job(dump, 3, second_log)
        assert second.wait(timeout=180) != 0
        said = second_log.read_text()
        assert first.poll() is None, first_log.read_text()[-3000:]
        assert contents(dump) == before and (dump / LOCK).read_text() == lock
        first.send_signal(signal.SIGTERM)  # torchrun hands it to its rank
        first.wait(timeout=120)
    finally:
        first.kill()
    (sentence,) = [line for line in said.splitlines() if line.startswith("error:")]
    holder = json.loads(lock)
    assert sentence == (
        f"error: job.dump_folder {dump} is in use by another run (host {socket.gethostname()}, pid {holder['pid']}, "
        "job "
        f"without an id, started {holder['started']}): two runs in one folder would overwrite each other's "
        "checkpoints; "
        "give this run another job.dump_folder, or stop that run first (a lock is never taken from a live process on "
        "its machine)"
    )
    assert "exitcode  : 2" in said  # torchrun's report of its rank
    assert said.startswith(sentence)  # the rank's sentence first; torchrun's own report of the failed rank follows
    stopped = re.search(r"stopped at step (\d+) on SIGTERM; exiting", first_log.read_text())
    assert stopped, first_log.read_text()[-3000:]
    assert (dump / "checkpoint" / f"step-{stopped.group(1)}" / ".metadata").is_file() and not (dump / LOCK).exists()
