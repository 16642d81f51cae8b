"""Async saves: the save in flight, its background thread and process group, and its host copy.

An async save costs the training loop only the building of the state dicts (references to the live
tensors, no copies). A background thread then copies ("stages") them into host buffers kept from one
save to the next (HostStaging) while the next step's forward and backward run; that step's
optimizer.step, the first thing to change the saved tensors, waits for the copy to finish (a step
pre-hook). The copy is then written in the background, with its collectives on a separate gloo
process group so they never interleave with training's. A new save first waits for the previous one.

The host copy. It is allocated at the first save and reused by every later one.

Allocating host memory for a whole training state is not free: pinned (page-locked) memory
especially costs seconds per GB to allocate and register, and a GPU run measured DCP's
per-save stager (a new one each save, as torch 2.11's cannot stage twice) losing ~7 s of
training per save. Here the buffers are made once, in the shape of the state dict (sharded
DTensors stay DTensors with host local tensors), and each later save only copies into them. A
state whose structure changed (e.g. the optimizer's moments appear after the first step) gets
new buffers. Reuse is safe because a save starts only after the previous one has finished
writing (CheckpointManager._save waits for it first).

On CUDA the device-to-host copy runs on a stream of its own, after the optimizer step that
made the state (`computed`), so the next step's forward and backward overlap with it; the
background thread that called `copy` waits for the stream, not the training thread.
"""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _check_state_dict_similarity, _copy_state_dict, _create_cpu_state_dict

from titanlite.checkpoint.integrity import record_checksums
from titanlite.errors import UserError
from titanlite.models.init import local_tensor


class HostStaging:
    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.buffers: dict | None = None
        self.stream = torch.cuda.Stream() if pinned else None

    def copy(self, state: dict, computed: "torch.cuda.Event | None") -> dict:
        """The state with every tensor replaced by its host copy (other values as they are)."""
        if self.buffers is None or not _check_state_dict_similarity(state, self.buffers):
            self.buffers = _create_cpu_state_dict(state, pin_memory=self.pinned)
        if self.stream is None:
            if computed is not None:
                computed.synchronize()
            return _copy_state_dict(state, self.buffers)
        with torch.cuda.stream(self.stream):
            if computed is not None:
                self.stream.wait_event(computed)
            staged = _copy_state_dict(state, self.buffers, non_blocking=True)
        self.stream.synchronize()
        return staged


def host_tensors(state) -> list[torch.Tensor]:
    """Every tensor leaf of a nested state dict (a DTensor's local tensor for a DTensor)."""
    if isinstance(state, dict):
        return [t for value in state.values() for t in host_tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in host_tensors(value)]
    if isinstance(state, torch.Tensor):
        return [local_tensor(state)]
    return []


@dataclass
class Save:
    """One save's timings (perf_counter seconds); `future` is set for an async one."""

    step: int
    started: float
    note: str = ""
    blocked: float = 0.0  # seconds training waited: for the previous save, the state dicts, the staging copy
    done_at: float = 0.0
    staged: threading.Event = field(default_factory=threading.Event)  # the copy in host memory is complete (or failed)
    future: Future | None = None  # the checkpoint is complete on disk
    finished: threading.Event = field(default_factory=threading.Event)

    def mark_done(self, _future: Future) -> None:
        self.done_at = time.perf_counter()
        self.finished.set()


class AsyncSaver:
    """At most one save in flight: start() hands it to a background thread, take() waits for it."""

    def __init__(self, pinned: bool, optimizer):
        if pinned and not torch.cuda.is_available():
            raise UserError(
                "checkpoint.async_mode async_with_pinned_mem stages into pinned (page-locked) memory for fast GPU "
                "copies and needs CUDA; on this CPU run use checkpoint.async_mode async"
            )
        # Async saves run their collectives from a background thread; on the training process
        # group they could interleave with the training collectives and deadlock.
        self.group = dist.new_group(backend="gloo")
        self.staging = HostStaging(pinned)
        optimizer.register_step_pre_hook(self._wait_for_staging)
        # Even starting a DCP save costs milliseconds of Python; this thread pays them instead.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
        self.pending: Save | None = None

    def start(self, save: Save, state: dict, path: Path) -> None:
        """Stage and write `state` in the background (the previous save must have been taken)."""
        # The copy may run on a CUDA stream of its own, which does not wait for training's stream:
        # it must start only once the GPU has finished the optimizer step that made this state.
        computed = torch.cuda.Event() if torch.cuda.is_available() else None
        if computed is not None:
            computed.record()
        save.future = self.thread.submit(self._save_in_background, state, path, save.staged, computed)
        save.future.add_done_callback(save.mark_done)
        self.pending = save

    def _save_in_background(
        self, state: dict, path: Path, staged: threading.Event, computed: "torch.cuda.Event | None"
    ) -> None:
        try:
            host_state = self.staging.copy(state, computed)
        finally:
            staged.set()  # on an error too: the optimizer step goes on and the save's future holds the error
        # This thread is the async part: a blocking save here overlaps training as DCP's async_save would.
        dcp.save(host_state, checkpoint_id=str(path), process_group=self.group)
        record_checksums(path, self.group.rank())

    def _wait_for_staging(self, *_hook_args) -> None:
        """Before every optimizer step: the tensors it updates in place must be copied first."""
        save = self.pending
        if save is not None and not save.staged.is_set():
            waited = time.perf_counter()
            save.staged.wait()
            save.blocked += time.perf_counter() - waited

    def finished(self) -> bool:
        """Whether the save in flight (if any) has completed (cheap; asked every step)."""
        return self.pending is not None and self.pending.finished.is_set()

    def take(self) -> Save | None:
        """Block until the save in flight (if any) is complete and hand it over; re-raises its error
        (the save is then no longer pending either way)."""
        save, self.pending = self.pending, None
        if save is not None:
            save.future.result()
            save.finished.wait()
        return save

    def shutdown(self) -> None:
        self.thread.shutdown(wait=True)
