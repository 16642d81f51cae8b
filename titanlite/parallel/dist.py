"""The one place that decides the device, the CUDA allocator and the collective backend.

job.device auto: CUDA + NCCL where a GPU is present, CPU + gloo otherwise; cuda or cpu pin one.
A CPU run hides the GPUs from its process before CUDA starts, so no part of it (titanlite's
CUDA checks, DCP, FSDP, torchao) touches them. Under torchrun the rank and world come from its
environment; run as a plain `python -m titanlite.train`, the job is a world of one with an
in-memory store, so the same code path (DeviceMesh, collectives, DCP) runs either way.
"""

import atexit
import faulthandler
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from titanlite.errors import UserError


@dataclass
class Generators:
    """rl.generator_ranks: the launch's last `count` ranks only generate (rl/generator.py). Trainers and generators
    meet at the launch's shared store, each run under a prefix of its own (tests/layout_runs.py runs several in one
    launch); the weights travel in a group of trainer 0 and the generators (weights_group)."""

    count: int
    trainers: int
    index: int | None  # this rank's place among the generators; None on a trainer
    store: dist.Store
    device: torch.device
    runs: int = 0
    run_store: dist.Store | None = None  # the current run's keys

    def begin_run(self) -> dist.Store:
        self.runs += 1
        self.run_store = dist.PrefixStore(f"titanlite/rl/run{self.runs}", self.store)
        return self.run_store

    def weights_group(self) -> dist.ProcessGroup:
        """Trainer 0 (rank 0) and the generators (1 .. count) of the current run: NCCL on GPUs, gloo on the CPU."""
        store = dist.PrefixStore("weights", self.run_store)
        rank, size = 0 if self.index is None else self.index + 1, self.count + 1
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(store, rank, size, PROCESS_GROUP_TIMEOUT)


@dataclass(frozen=True)
class DistInfo:
    rank: int  # in the default group: the trainers' (or, on a generator rank, the generators')
    world_size: int
    device: torch.device
    allocator_note: str = ""  # said once in the start-up log, once the logger exists
    generators: Generators | None = None  # rl.generator_ranks above 0

    @property
    def generating(self) -> bool:
        """Whether this rank is one of rl.generator_ranks, which only generate."""
        return self.generators is not None and self.generators.index is not None


def check_restartable() -> None:
    """torchrun --max-restarts with its rendezvous store shared with the workers (torch's default
    since 2.5) brings the restarted workers up on the failed attempt's keys in that store: they read
    the dead processes' addresses and cannot connect (pytorch/pytorch#135712, #167288). Stop at
    the start rather than at the first failure, hours later."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UserError(
            f"torchrun --max-restarts {restarts} needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
            "(with torch's shared rendezvous store, restarted workers read the failed attempt's addresses and cannot "
            "connect); export it before torchrun, as scripts/run_train.sh and multinode_trainer.slurm do, and use "
            "the c10d rendezvous (--standalone or --rdzv-backend c10d)"
        )


def meet_without_torchrun(rank: int, world_size: int, timeout_s: int) -> dist.TCPStore:
    """Ranks started by hand (or by Slurm/Kubernetes without torchrun) meet at rank 0's store;
    a rank that never starts would hang the others for torch's 30 minutes without a word."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    try:
        return dist.TCPStore(
            addr, port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s), wait_for_workers=True
        )
    except dist.DistError as error:
        joined = re.search(r"(\d+)/\d+ clients joined", str(error))  # rank 0 counts who came
        who = (
            f"{joined.group(1)} joined, {world_size - int(joined.group(1))} missing"
            if joined
            else f"rank {rank} could not reach rank 0 there"
        )
        raise UserError(
            f"the {world_size} ranks (WORLD_SIZE) did not meet at MASTER_ADDR:MASTER_PORT {addr}:{port} within "
            f"job.init_timeout_seconds {timeout_s}: {who}; start every RANK from 0 to {world_size - 1} with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise job.init_timeout_seconds"
        ) from None


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second since 2.9)
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def default_allocator_setting(environ: dict) -> str:
    """The CUDA allocator setting to add, "" when the user chose one. Without expandable segments,
    the 1B shape at seq 8192 ran out of memory at step 1 with 71.6 GiB reserved but only 57.2 GiB
    allocated (fragmentation); with them it trained in 72.8 GiB (measured on one H100 80GB, torch 2.11)."""
    return "" if any(name in environ for name in ALLOC_CONF_VARIABLES) else EXPANDABLE_SEGMENTS


def use_default_allocator() -> str:
    """Set the allocator default in this process's environment, read when CUDA first allocates
    (so every launcher gets it); returns the start-up log's sentence about it."""
    setting = default_allocator_setting(os.environ)
    if not setting:
        return ""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = setting
    return (
        f"PYTORCH_CUDA_ALLOC_CONF is not set: using {setting} (less fragmentation, fewer out-of-memory "
        "errors); set PYTORCH_CUDA_ALLOC_CONF to choose otherwise"
    )


def choose_device_type(requested: str, gpus: int, local_rank: int, local_world_size: int) -> str:
    """job.device against what this machine has: "cuda" or "cpu", or one sentence saying why neither fits."""
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu"
    if gpus == 0:
        raise UserError(
            "job.device cuda, but this process sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES); "
            "set job.device auto or cpu to run on the CPU"
        )
    if max(local_world_size, local_rank + 1) > gpus:
        raise UserError(
            f"{max(local_world_size, local_rank + 1)} processes on this machine but {gpus} visible GPU"
            f"{'s' if gpus > 1 else ''} (one process per GPU): launch with torchrun --nproc_per_node {gpus}, make "
            "more GPUs visible with CUDA_VISIBLE_DEVICES, or run on the CPU with --job.device cpu"
        )
    return "cuda"


def hide_gpus() -> None:
    """A CPU run: the GPUs disappear for this process (and its children) before CUDA starts.

    A process that has already asked CUDA for its GPUs (a test runner that imported torch.cuda's
    checks, then calls main() in-process) keeps seeing them whatever the variable says: there the
    variable is put back as it was, and the run goes on, on the CPU device and gloo it was given."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():  # CUDA counted the GPUs earlier in this process: too late to hide them
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def launch_world_size() -> int:
    """The processes of the launch (torchrun's, or WORLD_SIZE by hand); 1 run alone."""
    return int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device_choice: str, init_timeout_s: int, generator_ranks: int = 0) -> DistInfo:
    """This process's device and default group; with generator_ranks (rl.generator_ranks, checked against the world
    by rl/generator.py's check_generator_ranks) the default group of the first ranks is the trainers' and that of
    the last generator_ranks the generators' (every collective of training runs over the trainers only)."""
    check_restartable()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = launch_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # device_count() asks NVML or the runtime for the count without starting a CUDA context.
    gpus = torch.cuda.device_count() if device_choice != "cpu" else 0
    allocator_note = ""
    if choose_device_type(device_choice, gpus, local_rank, local_world_size) == "cuda":
        allocator_note = use_default_allocator()  # before the first allocation reads it
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside NCCL so CPU tensors (small bookkeeping collectives) also work.
        backend = "cuda:nccl,cpu:gloo"
    else:
        if device_choice == "cpu":
            hide_gpus()
        device = torch.device("cpu")
        backend = "gloo"
    device_id = device if device.type == "cuda" else None
    if generator_ranks:
        return split_world(backend, device, generator_ranks, init_timeout_s, allocator_note)
    if "MASTER_ADDR" in os.environ:
        # With torchrun's shared store (its default) its agent has already gathered every worker.
        store = (
            None
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            else meet_without_torchrun(rank, world_size, init_timeout_s)
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, world_size, device, allocator_note)


PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo, as init_process_group gives it


def launch_store(rank: int, world_size: int, init_timeout_s: int) -> dist.Store:
    """The store every rank of the launch shares: torchrun's agent's, or rank 0's by hand."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(address, port, is_master=False, timeout=PROCESS_GROUP_TIMEOUT)
    store = meet_without_torchrun(rank, world_size, init_timeout_s)
    store.set_timeout(PROCESS_GROUP_TIMEOUT)
    return store


def split_world(backend: str, device: torch.device, count: int, init_timeout_s: int, note: str) -> DistInfo:
    """The launch's first ranks the trainers' default group, its last `count` the generators' (rl.generator_ranks),
    each group's keys under its own prefix of the launch's store."""
    rank, world_size = int(os.environ.get("RANK", 0)), launch_world_size()
    store, trainers = launch_store(rank, world_size, init_timeout_s), world_size - count
    index = rank - trainers if rank >= trainers else None
    group_rank, group_size = (rank, trainers) if index is None else (index, count)
    prefix = "titanlite/trainers" if index is None else "titanlite/generators"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=group_rank,
        world_size=group_size,
        device_id=device if device.type == "cuda" else None,
    )
    return DistInfo(group_rank, group_size, device, note, Generators(count, trainers, index, store, device))


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


EXIT_SECONDS = 10.0  # the longest leaving may take: torchrun and Kubernetes kill 30 s after SIGTERM
SAY_SECONDS = 2.0  # how long the note of a late exit may take to write (stderr may be a pipe nobody reads)


def exit_process(code: int) -> NoReturn:
    """Leave the trainer's process with `code`: first all that Python's own exit does for Python code (join
    the non-daemon threads, run the atexit handlers, which close the log files and stop multiprocessing's
    children; flush stdout and stderr), then os._exit, which skips only the interpreter's teardown; all within
    EXIT_SECONDS (leave_anyway_after).

    That teardown aborted finished runs. destroy_process_group() cannot free the world group: DeviceMesh
    reuses it for world-sized dims, and the meshes, FSDP's states and DTensor's caches keep it and the mesh
    groups alive, with their gloo worker threads, which only freeing a group joins. A worker that frees a
    collective's tensor after Python has let go of it needs the GIL; when it asks once the teardown has begun
    (a worker the scheduler starved, under load), Python ends the thread with pthread_exit inside a C++
    destructor and the process aborts with "terminate called without an active exception" (gdb:
    pt_gloo_runloop, ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread),
    so torchrun reports the finished run as failed."""
    leave_anyway_after(EXIT_SECONDS, code)
    threading._shutdown()  # the interpreter's own first step at exit: joins the threads, stops thread pools
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_anyway_after(seconds: float, code: int) -> None:
    """End the process with `code` `seconds` from now if it is still there: a run that has said it is exiting (its
    work saved) must not hold its nodes until the scheduler kills it. What kept it (a thread joined at exit that
    waits on a peer or a service that is gone, an exit handler, a blocked write) is written to stderr first, with
    every thread's stack, as far as stderr takes it within SAY_SECONDS. Where a thread holds the GIL all along (a C++
    destructor waiting on a peer), no Python thread runs: faulthandler's own watchdog, a C thread, then writes the
    stacks and ends the process with exit code 1 at twice `seconds` (an exit handler that is only slow, under load,
    keeps its own code)."""
    faulthandler.dump_traceback_later(2 * seconds, exit=True)

    def leave() -> None:
        time.sleep(seconds)
        saying = threading.Thread(target=say_late_exit, args=(seconds, code), name="late-exit-note", daemon=True)
        saying.start()
        saying.join(SAY_SECONDS)
        os._exit(code)

    threading.Thread(target=leave, name="exit-deadline", daemon=True).start()


def say_late_exit(seconds: float, code: int) -> None:
    print(
        f"warning: the process was still exiting {seconds:.0f} s after its run ended; it leaves now with exit code "
        f"{code} (where each thread was:)",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


REPORTED_KEY = "titanlite/user_error"
REPORT_WAIT = timedelta(seconds=10)  # how long a rank waits for the sentence to be printed before it exits


def say_user_error(text: str, met: bool) -> None:
    """Print a user error's sentence once for the whole job. Under torchrun the first rank to fail prints
    it and the others wait until it has: torchrun kills every rank once one exits, so a rank that left
    the printing to rank 0 could take rank 0's sentence with it. Ranks started without torchrun: rank 0
    speaks for all once they have met (`met`), and before that each speaks, as any may be the one missing."""
    store = torchrun_store() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    if store is None:
        if os.environ.get("RANK", "0") == "0" or not met:
            print(text, file=sys.stderr, flush=True)
        return
    try:
        if store.add(REPORTED_KEY, 1) > 1:
            store.wait([f"{REPORTED_KEY}/printed"], REPORT_WAIT)
            return
    except dist.DistError:  # the first rank died before printing: better twice than never
        pass
    print(text, file=sys.stderr, flush=True)
    try:
        store.set(f"{REPORTED_KEY}/printed", "1")
    except dist.DistError:
        pass


def torchrun_store() -> dist.TCPStore | None:
    """The store torchrun's agent shares with every rank of the job (the process group's store under
    it), reachable before the group exists and after it is closed; None without torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=REPORT_WAIT
        )
    except (dist.DistError, KeyError, ValueError):
        return None
