"""The host copy an async save writes, allocated at the first save and reused by every later one.

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

import torch
from torch.distributed._state_dict_utils import _check_state_dict_similarity, _copy_state_dict, _create_cpu_state_dict

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
