"""Throughput, FLOPs, MFU and memory: the console line and TensorBoard.

MFU = achieved FLOP/s / peak FLOP/s of one device, where achieved FLOP/s = tokens per second
per device x FLOPs per token, and FLOPs per token (each family's flops_per_token) is
6 * (parameters - embedding parameters) + 12 * layers * heads * head_dim * seq_len:
the matmul work of forward + backward (2 + 4 FLOPs per weight per token) plus attention scores.
Peaks are dense bf16 tensor-core numbers from the vendors' data sheets; where none is known
(any CPU) the line says mfu is not known rather than inventing one.

TensorBoard (run folders, config, hyper-parameters, layout: tensorboard.py) receives the same
figures under grouped tags: TB_TAGS below, validation's loss/validation and
perplexity/validation, checkpoint/* (checkpoint/cost.py) and a model's own (MoE: moe/*).
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config_sections import JobConfig, Metrics
from titanlite.log import Progress, duration, logger
from titanlite.metrics.observers import observer
from titanlite.metrics.tensorboard import describe_run, open_writer

# Dense bf16 TFLOP/s (no sparsity), matched against torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200 NVL", 835.0),  # the PCIe card: lower clocks than the SXM H200 (NVIDIA's spec, 1,671 with sparsity)
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("A100", 312.0),
]


def peak_tflops(device: torch.device, override: float) -> float | None:
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


# The console line's figures -> their TensorBoard tags (shares are fractions, MFU a percentage).
TB_TAGS = {
    "loss": "loss/train",
    "tps": "throughput/tps",
    "tflops": "throughput/tflops",
    "mfu_pct": "throughput/mfu",
    "memory_gib": "memory/reserved_gib",
    "memory_share": "memory/share",
    "memory_capacity_gib": "memory/capacity_gib",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "data_loading_share": "data/wait_share",
    "trained_tokens": "data/trained_tokens",
    "epoch": "data/epoch",
    "step_seconds": "time/step_seconds",
}


def memory_usage(device: torch.device) -> tuple[float, float]:
    """(GiB used, GiB of the device): CUDA max reserved, or this process's RSS on the CPU."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[1]) * page
        total = os.sysconf("SC_PHYS_PAGES") * page
    return used / 2**30, total / 2**30


# An objective's scalars that the step line shows too: tag -> (label, format). GRPO's say why a reward moves or not:
# the share of groups whose completions all scored alike (their advantages are 0), how long the completions are,
# and the share of tokens whose ratio the clip held.
CONSOLE_EXTRAS = {
    "rl/reward": ("reward", "{:.4f}"),
    "rl/frac_reward_zero_std": ("equal_reward_groups", "{:.0%}"),
    "rl/completion_length": ("completion_tokens", "{:.1f}"),
    "rl/clip_ratio": ("clipped", "{:.1%}"),
}
PROGRESS_SECONDS = 30.0  # a progress line at least this often between step lines, whatever metrics.log_freq is


def untrained_note(extra: dict[str, float], steps: int) -> str | None:
    """The sentence for GRPO steps that trained nothing (or the KL term alone), and why; None where they trained."""
    if extra.get("rl/frac_reward_zero_std") != 1.0:
        return None
    span = "this step" if steps == 1 else f"the {steps} steps since the last line"
    why = (
        f"in {span} every group's completions had equal rewards (mean {extra['rl/reward']:.4f}), so every "
        "advantage is 0"
    )
    if "rl/kl" in extra:
        return f"{why}: only the KL term (rl.beta) to the reference trained"
    return (
        f"{why} and {span} trained nothing (loss and gradients 0); groups differ with more completions per prompt "
        "(rl.num_generations), a higher rl.temperature, or prompts neither always nor never solved"
    )


class MetricsLogger:
    """Accumulates tokens and time between log steps, prints the line, writes TensorBoard
    (from start_tensorboard() on: the run folder depends on the step the job resumed from)."""

    def __init__(self, cfg: Metrics, rank: int, device: torch.device, flops_per_token: float):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops(device, cfg.peak_tflops)
        self.writer = None
        self.dashboard = None  # rank 0's CUSTOM SCALARS layout (tensorboard.py), which grows as tag groups appear
        self.last_step = 0  # the step of the last line (or the one resumed from): lines cover the steps since
        self.progress: Progress | None = None  # from start_progress on: steps done of the run's, time left
        self.reset()

    def start_progress(
        self, resumed_step: int, steps: int, every_seconds: float = PROGRESS_SECONDS, clock=time.monotonic
    ) -> None:
        """Time the steps from here (a resumed run's earlier steps count towards the total, not the step time)."""
        self.progress = Progress(steps, "train", every_seconds, already=resumed_step, clock=clock)

    @observer("metrics")
    def step_done(self, step: int, logged: bool) -> None:
        """Count the step; a progress line where no step line has been printed for PROGRESS_SECONDS. A step that is
        logged is counted silently: its step line tells the same, and log() restarts the interval."""
        if self.progress is None:
            return
        self.progress.advance(step - self.progress.count, quiet=logged)

    @observer("TensorBoard")
    def start_tensorboard(self, folder: Path | None, job: JobConfig, resumed_step: int, hparams: dict) -> None:
        """Open this rank's run in `folder` (tensorboard.run_folder: continuing the job's after a resume; None
        writes nothing); rank 0 describes the run."""
        self.last_step = resumed_step
        if folder is None:
            return
        self.writer = open_writer(folder, self.rank, resumed_step)
        if self.rank == 0:
            self.dashboard = describe_run(
                self.writer, job, hparams, resumed_step, self.peak is not None, self.device.type
            )

    @observer("TensorBoard")
    def write_scalars(self, step: int, values: dict[str, float], flush: bool = False) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            if self.dashboard:
                self.dashboard.saw(values)
            if flush:
                self.writer.flush()  # a killed run keeps what it has drawn (SummaryWriter flushes every 2 minutes)

    def trained_per_step(self, step: int) -> float:
        """The trained tokens of the whole global batch, per step since the last line: an all-reduce every rank
        runs, outside the observer `log`."""
        total = torch.tensor([self.trained], dtype=torch.float64)
        if dist.is_initialized():
            total = total.to(self.device)
            dist.all_reduce(total)
        return float(total.item()) / max(step - self.last_step, 1)

    def reset(self) -> None:
        self.trained = 0.0
        self.tokens = 0
        self.data_seconds = 0.0
        self.started = time.perf_counter()

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0

    def throughput(self, tokens: int, seconds: float) -> tuple[float, float, float | None]:
        """(tokens/s per device, achieved TFLOP/s, MFU in percent or None where no peak is known)."""
        tps = tokens / seconds
        tflops = tps * self.flops_per_token / 1e12
        return tps, tflops, (100.0 * tflops / self.peak if self.peak else None)

    @observer("metrics")
    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
        trained: float = 0.0,
        epoch: float | None = None,
    ) -> dict:
        """The step line and its scalars; `trained` is trained_per_step's count, `epoch` the passes over the data
        so far where the data has epochs."""
        elapsed = time.perf_counter() - self.started
        steps = max(step - self.last_step, 1)
        tps, tflops, mfu_pct = self.throughput(self.tokens, elapsed)
        mem_gib, capacity_gib = memory_usage(self.device)
        values = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "memory_gib": mem_gib,
            "memory_share": mem_gib / capacity_gib,
            "memory_capacity_gib": capacity_gib,
            "data_loading_share": self.data_seconds / elapsed,
            "trained_tokens": trained,
            "step_seconds": elapsed / steps,
        }
        if epoch is not None:
            values["epoch"] = epoch
        mfu = "mfu: unknown"
        if mfu_pct is not None:
            values["mfu_pct"] = mfu_pct
            mfu = f"mfu: {mfu_pct:.2f}%"
        logger.info(
            f"step: {step}  loss: {loss:.4f}  grad_norm: {grad_norm:.4f}  memory: "
            f"{mem_gib:.2f}GiB({100 * values['memory_share']:.2f}%)  "
            f"tps: {tps:,.0f}  tflops: {tflops:.2f}  {mfu}  data: {100 * values['data_loading_share']:.1f}%  trained: "
            f"{trained:,.0f}"
            + ("" if epoch is None else f"  epoch: {epoch:.3f}")
            + f"  step_time: {elapsed / steps:.2f}s"
            + self.time_left()
            + "".join(
                f"  {label}: {form.format(extra[tag])}"
                for tag, (label, form) in CONSOLE_EXTRAS.items()
                if tag in (extra or {})
            )
        )
        if note := untrained_note(extra or {}, steps):
            logger.info(note)
        if self.progress is not None:
            self.progress.reported()  # the step line told where the run stands
        # A model's own figures (MoE: moe/*) arrive under their tags already.
        self.write_scalars(step, {TB_TAGS[name]: value for name, value in values.items()} | (extra or {}), flush=True)
        self.last_step = step
        self.reset()
        return values

    def time_left(self) -> str:
        """The step line's `  left: 4m 05s` (at the mean step time of this process, validation and saves included)."""
        left = self.progress.seconds_left() if self.progress is not None else None
        return "" if left is None else f"  left: {duration(left)}"

    @observer("metrics")
    def log_validation(
        self, step: int, loss: float, perplexity: float, batches: int, tokens: int, seconds: float
    ) -> None:
        """The validation line and validation/* scalars; its time is left out of the next tps."""
        logger.info(
            f"validate step: {step}  loss: {loss:.4f}  perplexity: {perplexity:.4f}  "
            f"batches: {batches}  tokens: {tokens:,}  time: {seconds:.2f}s"
        )
        self.write_scalars(step, {"loss/validation": loss, "perplexity/validation": perplexity})
        self.started += seconds

    @observer("TensorBoard")
    def close(self) -> None:
        if self.writer:
            self.writer.close()


def tokens_by_source(dataloader) -> dict[str, int]:
    """Tokens each source of a training.dataset_mix has given all ranks so far; {} for one source."""
    seen = dataloader.tokens_by_source() if hasattr(dataloader, "tokens_by_source") else {}
    return seen if len(seen) > 1 else {}


def source_scalars(dataloader) -> dict[str, float]:
    """TensorBoard tags data/tokens_seen/<n>_<source name> of a mix."""
    return {f"data/tokens_seen/{name}": float(tokens) for name, tokens in tokens_by_source(dataloader).items()}


def log_tokens_by_source(dataloader) -> None:
    """The end-of-run line of a mix: each source's tokens and its share of all."""
    seen = tokens_by_source(dataloader)
    if seen:
        total = sum(seen.values())
        logger.info(
            "data mix: "
            + ", ".join(f"{name} {tokens:,} tokens ({100 * tokens / total:.1f}%)" for name, tokens in seen.items())
        )


def speed_settings(cfg: JobConfig) -> dict[str, str]:
    """Activation checkpointing, compile, float8 and loss chunks as the run uses them (start-up line, TensorBoard
    hparams)."""
    ac = cfg.activation_checkpoint
    ac_text = f"selective ({ac.selective_ac_option})" if ac.mode == "selective" else ac.mode
    compile_text = ",".join(cfg.compile.components) if cfg.compile.enable else "off"
    float8_text = cfg.float8.recipe_name if cfg.float8.enable else "off"
    chunks_text = f"{cfg.training.loss_chunk_tokens} tokens" if cfg.training.loss_chunk_tokens else "off"
    return {"AC": ac_text, "compile": compile_text, "float8": float8_text, "loss chunks": chunks_text}


def speed_features(cfg: JobConfig) -> str:
    return " | ".join(f"{name} {value}" for name, value in speed_settings(cfg).items())


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)  # gloo has no AVG; sum and divide
    return value.item() / dist.get_world_size()


def model_metrics(model) -> dict[str, float] | None:
    """What a model reports about itself since the last log (e.g. MoE expert load), averaged over ranks."""
    values = model.extra_metrics() if hasattr(model, "extra_metrics") else {}
    if not values:
        return None
    stacked = torch.stack([v.float() for v in values.values()])
    dist.all_reduce(stacked)
    return dict(zip(values, (stacked / dist.get_world_size()).tolist()))
