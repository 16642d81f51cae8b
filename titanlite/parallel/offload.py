"""Offloading to CPU memory: FSDP's parameters, gradients and optimizer state, and activations.

- parallelism.fsdp_cpu_offload: FSDP2's CPUOffloadPolicy keeps the sharded parameters, their
  gradients and so the optimizer state in CPU memory (pinned on CUDA); each block's parameters
  are copied to the GPU for its all-gather and its gradients back after the reduce-scatter, and
  the optimizer steps on the CPU. It needs FSDP, i.e. more than one data-parallel rank.
- activation_checkpoint.offload_activations: every tensor the forward saves for backward (but
  the parameters, which stay anyway) goes to CPU memory (pinned on CUDA) and comes back when
  backward needs it, with its size and strides: a compiled backward asserts them (torch's
  save_on_cpu brings tensors back contiguous, which crashed compiled runs). On CUDA the copies run
  on a stream of their own, overlapped with compute: forward's device-to-host copies as soon as a
  tensor is made, backward's host-to-device copies a few tensors ahead of their use. On a CPU run
  activations already live in CPU memory: the copies are made as asked, but they save nothing,
  and the run says so at start. `HeldBytes` counts the bytes held in host memory, for the run summary.
"""

import contextlib
import weakref

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.multiprocessing.reductions import StorageWeakRef

from titanlite.errors import UserError
from titanlite.log import logger


def fsdp_offload_policy(enabled: bool) -> OffloadPolicy:
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if enabled else OffloadPolicy()


def check_fsdp_offload(enabled: bool, fsdp_enabled: bool) -> None:
    if enabled and not fsdp_enabled:
        raise UserError(
            "parallelism.fsdp_cpu_offload offloads FSDP's shards and needs FSDP, i.e. more than one "
            "data-parallel rank; launch with torchrun --nproc_per_node N, or set it false"
        )


def optimizer_device_type(fsdp_cpu_offload: bool, device_type: str) -> str:
    """Where the optimizer steps: with FSDP offload, the parameters it updates live on the CPU."""
    return "cpu" if fsdp_cpu_offload else device_type


def note_if_offload_saves_nothing(offload_activations: bool, device_type: str) -> None:
    if offload_activations and device_type == "cpu":
        logger.info(
            "activation_checkpoint.offload_activations on a CPU run: activations already live in CPU "
            "memory, so the copies cost time and save nothing"
        )


class HeldBytes:
    """Bytes of saved activations in host memory: `live` now, `peak` the most at once over the run.
    On CUDA that is device memory the activations did not hold (the run summary reports the peak)."""

    def __init__(self):
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def remove(self, nbytes: int) -> None:
        self.live -= nbytes


def activation_offload_context(held: HeldBytes | None):
    """Around the forward: saved activations go to CPU memory until backward, counted in `held`;
    None = no offload."""
    if held is None:
        return contextlib.nullcontext()
    return OffloadActivations(held)


def storage_span(tensor: torch.Tensor) -> torch.Tensor:
    """The elements a strided view reaches, from its first one, as one contiguous 1-D view: copying
    it and rebuilding the view with the same size and strides works for any view (gaps, transposes,
    expanded dimensions); only the storage offset becomes 0, which is at least as aligned."""
    extent = (
        1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
    )
    return tensor.as_strided((extent,), (1,))


class _Offloaded:
    """A saved tensor in host memory; `ready` marks its copy back to the device (CUDA; `stream` is the side
    stream of a CUDA tensor's copies, None for a CPU tensor, also on a machine with a GPU). `uses` counts
    the ops that saved it (wq, wk and wv all save the same normed input): one copy out, one copy back,
    and the copy back lives until the last of them has taken it in backward."""

    __slots__ = (
        "index",
        "host",
        "shape",
        "stride",
        "device",
        "stream",
        "on_device",
        "ready",
        "uses",
        "taken",
        "held",
        "__weakref__",
    )

    def __init__(self, index: int, tensor: torch.Tensor, stream, held: HeldBytes):
        self.index, self.shape, self.stride, self.device = index, tensor.shape, tensor.stride(), tensor.device
        self.stream = stream
        self.on_device = self.ready = None
        self.uses, self.taken = 1, 0
        span = storage_span(tensor)
        self.host = torch.empty(span.shape, dtype=span.dtype, pin_memory=stream is not None)
        self.held = held
        held.add(self.host.nbytes)
        if stream is None:
            self.host.copy_(span)
            return
        stream.wait_stream(torch.cuda.current_stream())  # the tensor is being computed on the main stream
        with torch.cuda.stream(stream):
            self.host.copy_(span, non_blocking=True)
        # The main stream may free the tensor now; its memory is not reused before the copy is done.
        span.record_stream(stream)

    def fetch(self) -> None:
        """Start the copy back (on the side stream, after the copy out on the same stream)."""
        stream = self.stream
        self.on_device = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        if stream is None:
            self.on_device.copy_(self.host)
            return
        stream.wait_stream(torch.cuda.current_stream())  # the memory may have been in use by the main stream
        with torch.cuda.stream(stream):
            self.on_device.copy_(self.host, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.on_device.record_stream(stream)

    def take(self) -> torch.Tensor:
        if self.on_device is None:
            self.fetch()
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        tensor = self.on_device.as_strided(self.shape, self.stride)
        self.taken += 1
        if self.taken % self.uses == 0:  # its last user: a later unpack (retain_graph) fetches again
            self.on_device, self.ready = None, None
        return tensor

    def __del__(self):  # autograd frees the saved tensor: after its backward, or with the graph
        self.held.remove(self.host.nbytes)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """saved_tensors_hooks for one forward. Backward uses saved tensors in about the reverse order of
    forward, so unpacking one starts the copies back of the PREFETCH saved just before it."""

    PREFETCH = 8  # about half a transformer block's saved tensors: enough to hide a copy behind compute

    def __init__(self, held: HeldBytes):
        self.held = held
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.saved: list[weakref.ref] = []  # in forward order; an entry dies with its saved tensor
        # (storage address, offset, size, strides, version) -> (the storage, its _Offloaded), both weakly:
        # a tensor saved again while its storage lives is the same data, so it is copied once.
        self.copies: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        # Parameters and their views (Linear saves weight.t()) stay on the device anyway: copying them
        # would move every weight out and back each step and save nothing. Tensor subclasses and
        # sparse tensors keep their own storage.
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, torch.nn.Parameter) or type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor._version)
        storage_ref, offloaded_ref = self.copies.get(key, (None, None))
        # Two live storages never share an address, so a live earlier one with this key is this one.
        offloaded = offloaded_ref() if storage_ref is not None and not storage_ref.expired() else None
        if offloaded is not None:
            offloaded.uses += 1
            return offloaded
        offloaded = _Offloaded(len(self.saved), tensor, self.stream if tensor.is_cuda else None, self.held)
        self.saved.append(weakref.ref(offloaded))
        self.copies[key] = (StorageWeakRef(storage), weakref.ref(offloaded))
        return offloaded

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.stream is not None:
            for ref in self.saved[max(0, packed.index - self.PREFETCH) : packed.index]:
                earlier = ref()
                if earlier is not None and earlier.on_device is None and not earlier.taken:  # not yet in backward
                    earlier.fetch()
        return packed.take()
