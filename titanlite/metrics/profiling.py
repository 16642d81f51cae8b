"""torch.profiler traces, CUDA memory snapshots, and the run's steady-state summary.

Traces: with profiling.enable_profiling, one step in every profile_freq is recorded (after a
few warm-up steps of the profiler) and written per rank to
<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json, a Chrome trace that
Perfetto (ui.perfetto.dev) or TensorBoard's profiler plugin opens.

Memory snapshots (CUDA only): with profiling.enable_memory_snapshot, the CUDA caching allocator
records every allocation with its stack from the start of the run; every profile_freq steps, and
when the run dies of CUDA out-of-memory, each rank dumps
<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle
(or .../oom/rank<r>_memory_snapshot.pickle), which pytorch.org/memory_viz draws. A CPU run
refuses the option: the CPU allocator keeps no such history.
"""

import pickle
import resource
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config_sections import Profiling
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.metrics.observers import observer
from titanlite.models.init import local_tensor

_PROFILER_WARMUP = 3  # steps the profiler runs unrecorded before the recorded one
_SNAPSHOT_ENTRIES = 100_000  # allocation events kept by the CUDA allocator's history


class StepProfiler:
    """Use as `with StepProfiler(...) as profiler:` around the loop and call profiler.step(step)
    at the end of every training step."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device):
        if cfg.enable_memory_snapshot and device.type != "cuda":
            raise UserError(
                "profiling.enable_memory_snapshot records the CUDA allocator's history and needs a GPU; this run is "
                "on CPU: set it false (profiling.enable_profiling traces work on CPU)"
            )
        self.cfg, self.rank, self.device = cfg, rank, device
        self.traces = Path(dump_folder) / cfg.save_traces_folder
        self.snapshots = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.profiler: torch.profiler.profile | None = None
        if cfg.enable_memory_snapshot:
            # Started here, before the model is built, so the snapshots show where every byte came from.
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)

    @observer("profiling")
    def __enter__(self) -> "StepProfiler":
        if self.cfg.enable_profiling:
            freq = self.cfg.profile_freq
            warmup = min(_PROFILER_WARMUP, freq - 1)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=freq - warmup - 1, warmup=warmup, active=1),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            # Each trace holds its own step only, which is what we want; the profiler warns about it.
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            self.profiler.__enter__()
            logger.info(f"profiling one step in every {freq}; traces go to {self.traces}")
        return self

    def _save_trace(self, profiler: torch.profiler.profile) -> None:
        # The profiler's step count follows the training step (see step()), so this names the step recorded.
        folder = self.traces / f"iteration_{profiler.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))

    @observer("profiling")
    def step(self, step: int) -> None:
        """End of training step `step` (1-based; continues after a resume)."""
        if self.profiler is not None:
            self.profiler.step_num = step - 1  # profiler.step() adds the 1
            self.profiler.step()
        if self.cfg.enable_memory_snapshot and step % self.cfg.profile_freq == 0:
            self._dump_snapshot(f"iteration_{step}")

    def _dump_snapshot(self, name: str) -> Path:
        folder = self.snapshots / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        with open(path, "wb") as file:
            pickle.dump(torch.cuda.memory._snapshot(), file)
        return path

    @observer("profiling")
    def __exit__(self, exc_type, exc, tb) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(exc_type, exc, tb)
        if self.cfg.enable_memory_snapshot:
            if exc_type is not None and issubclass(exc_type, torch.cuda.OutOfMemoryError):
                path = self._dump_snapshot("oom")
                logger.error(f"CUDA out of memory; the memory snapshot of rank {self.rank} is in {path}")
            torch.cuda.memory._record_memory_history(enabled=None)


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""

    def size(tensor: torch.Tensor) -> int:
        local = local_tensor(tensor)
        return local.numel() * local.element_size()

    params = list(model.parameters())
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(s) for s in states),
    }


def state_peaks_over_ranks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, offloaded=None) -> dict[str, int]:
    """The largest shard of each kind of state over all ranks (what must fit on a device), and the largest
    activation offload peak: a collective every rank runs, so it is never inside an observer."""
    state = model_state_bytes(model, optimizer)
    per_rank = torch.tensor([*state.values(), offloaded.peak if offloaded else 0], dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    return dict(zip([*state, "offloaded"], map(int, per_rank.tolist())))


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: the most memory tensors held at once; CPU: the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class RunSummary:
    """Steady-state numbers of the whole run, logged once at the end as a `run summary:` line.

    Call step_began(metrics) and step_ended(metrics) around each training step. The clock runs from the start
    of the first step after `warmup` steps (compilation, allocator warm-up) to the end of the last
    step, so the logging, stop checks and gc between steps are inside it. On CUDA it is read
    after a synchronize, at those two moments only. Its tokens are those the step line counts (step.py's
    step_batches): a DPO micro-batch is as wide as its longest pair, not seq_len.
    """

    def __init__(self, warmup: int, steps_to_run: int, device: torch.device, predicted=None):
        """`predicted`: the planner's JobPlan for this run (titanlite/plan), compared with what was measured."""
        self.predicted = predicted
        self.warmup = max(0, min(warmup, steps_to_run - 1))
        self.steps_to_run = steps_to_run
        self.device = device
        self.seen = 0  # steps run so far
        self.data_seconds = 0.0
        self.data_before = 0.0
        self.tokens = 0  # this rank's, in the timed steps
        self.tokens_before = 0
        self.started: float | None = None
        self.ended: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def steps(self) -> int:
        return max(0, self.seen - self.warmup)

    @observer("run summary")
    def step_began(self, metrics) -> None:
        if self.seen == self.warmup:
            self.started = self._now()
        self.data_before = metrics.data_seconds  # train_step adds its wait for data, and the tokens it reads
        self.tokens_before = metrics.tokens

    @observer("run summary")
    def step_ended(self, metrics) -> None:
        self.seen += 1
        if self.seen > self.warmup:
            self.data_seconds += metrics.data_seconds - self.data_before
            self.tokens += metrics.tokens - self.tokens_before
            if self.seen == self.steps_to_run:
                self.ended = self._now()

    @observer("run summary")
    def log(self, state_peaks: dict[str, int], metrics, save_cost=None, offloaded=None) -> None:
        """`state_peaks` (state_peaks_over_ranks, computed outside this observer: a collective), the largest
        rank's params, grads, optimizer state and activation offload peak in bytes; `save_cost`
        (checkpoint/cost.py's SaveCost) adds the training time checkpoint saves lost; `offloaded`
        (parallel/offload.py's HeldBytes) says activation offload was on."""
        if not self.steps:
            return
        elapsed = (self.ended or self._now()) - self.started
        tps, tflops, mfu_pct = metrics.throughput(self.tokens, elapsed)
        mfu = "unknown" if mfu_pct is None else f"{mfu_pct:.2f}%"
        exact = {name: state_peaks[name] for name in ("params", "grads", "optimizer")}
        offloaded_peak = state_peaks["offloaded"]
        mib = {name: value / 2**20 for name, value in exact.items()}
        tail = ""
        if save_cost is not None and save_cost.saves:
            tail = f"  checkpoints: {save_cost.saves} saves, training lost {save_cost.lost_seconds:.3f}s"
        if offloaded is not None:
            # On a CPU run the activations live in host memory either way.
            saved = "not held on the device" if self.device.type == "cuda" else "no memory saved on a CPU run"
            tail += f"  activation_offload: peak {offloaded_peak / 2**30:.3f}GiB held in host memory ({saved})"
        logger.info(
            f"run summary: {self.steps} steps after {self.warmup} warm-up  tps: {tps:,.0f}  "
            f"step: {elapsed / self.steps:.4f}s  tflops: {tflops:.3f}  mfu: {mfu}  "
            f"peak_memory: {peak_memory_gib(self.device):.3f}GiB  data: {100 * self.data_seconds / elapsed:.2f}%  "
            f"state_per_rank: params {mib['params']:.3f}MiB grads {mib['grads']:.3f}MiB "
            f"optimizer {mib['optimizer']:.3f}MiB total {sum(mib.values()):.3f}MiB{tail}"
        )
        offload_bytes = f" activation_offload_peak {offloaded_peak}" if offloaded is not None else ""
        logger.info(
            f"run summary: state_per_rank_bytes params {exact['params']} grads {exact['grads']} "
            f"optimizer {exact['optimizer']}{offload_bytes}"
        )
        if self.predicted is not None:
            planned = self.predicted
            logger.info(
                f"run summary: predicted vs measured: peak_memory {planned.memory.peak / 2**30:.3f}GiB vs "
                f"{peak_memory_gib(self.device):.3f}GiB  tps {planned.speed.tps:,.0f} vs {tps:,.0f}"
            )
