"""Side-by-side benchmarks of titanlite: its trainer against a bare PyTorch loop, and its knobs.

    python scripts/benchmark.py                  # the default table (see ROWS), debug model, seq 256, batch 4
    python scripts/benchmark.py --rows bare,titanlite --repeats 5
    python scripts/benchmark.py --short          # a few tiny steps of the bare/titanlite/fsdp2/checkpoint rows (tests)
    python scripts/benchmark.py --precision      # loss curves: fp32 AdamW vs pure bf16 with and without Kahan
    python scripts/benchmark.py --loader         # tokens/s the token-store data loader delivers per process

Every row is a fresh process run the way a user runs it: the trainer as `python -m titanlite.train`
(or under torchrun), timed by its own end-of-run `run summary:` line, which leaves out the same
warm-up steps the bare loop leaves out. The bare loop (`--bare-loop`, run by this script in a
subprocess) builds the same llama model directly and trains it with plain AdamW on random tokens
of the same shapes, so `vs bare` is titanlite's own overhead. Bare and titanlite runs alternate
(--repeats) and the medians are compared, so a machine that gets busier during the run hurts both.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = str(ROOT / "train_configs" / "debug_model.toml")

# name -> (what it is, extra trainer flags, processes); "bare" is the bare PyTorch loop.
PURE_BF16 = ["--training.param_dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]
ROWS = {
    "bare": ("bare PyTorch loop: same model, batch, AdamW, clipping", [], 1),
    "titanlite": ("titanlite trainer, same job", [], 1),
    "ac_full": ("+ activation_checkpoint.mode full", ["--activation_checkpoint.mode", "full"], 1),
    "ac_op": ("+ selective op-level AC", ["--activation_checkpoint.mode", "selective"], 1),
    "ac_every2": (
        "+ selective AC of every 2nd block",
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
        1,
    ),
    "compile": ("+ compile.enable (model + loss, inductor)", ["--compile.enable"], 1),
    "bf16_kahan": ("pure bf16 weights + AdamWBF16Kahan", [*PURE_BF16, "--optimizer.name", "AdamWBF16Kahan"], 1),
    "fsdp2": ("FSDP over 2 ranks (torchrun), per-rank numbers", [], 2),
    "tp2": (
        "tensor + sequence parallel over 2 ranks (torchrun), per-rank numbers",
        ["--parallelism.tensor_parallel_degree", "2"],
        2,
    ),
    "pp2": (
        "pipeline parallel over 2 ranks, 1F1B, microbatch 1 (torchrun), per-rank numbers",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
        2,
    ),
    "ckpt_sync": ("synchronous checkpoint saves", ["--checkpoint.enable", "--checkpoint.async_mode", "disabled"], 1),
    "ckpt_async": ("async checkpoint saves", ["--checkpoint.enable", "--checkpoint.async_mode", "async"], 1),
    # Random tokens hold no documents, so these two read the sample corpus (packed help topics).
    "mask_causal": ("sample corpus, model.attention_mask causal", ["--training.dataset", "sample"], 1),
    "mask_block_causal": (
        "sample corpus, block_causal (attention inside documents)",
        ["--training.dataset", "sample", "--model.attention_mask", "block_causal"],
        1,
    ),
}
DEFAULT_ROWS = (
    "bare,titanlite,ac_full,ac_op,ac_every2,compile,bf16_kahan,fsdp2,tp2,pp2,ckpt_sync,ckpt_async,mask_causal,"
    "mask_block_causal"
)
SHORT_ROWS = "bare,titanlite,fsdp2,ckpt_sync,ckpt_async"

SUMMARY = re.compile(
    r"run summary: (?P<steps>\d+) steps after (?P<warmup>\d+) warm-up  tps: (?P<tps>[\d,]+)  step: (?P<step>[\d.]+)s  "
    r"tflops: (?P<tflops>[\d.]+)  mfu: (?P<mfu>\S+)  peak_memory: (?P<mem>[\d.]+)GiB  data: (?P<data>[\d.]+)%  "
    r"state_per_rank: params (?P<params>[\d.]+)MiB grads (?P<grads>[\d.]+)MiB optimizer (?P<optim>[\d.]+)MiB "
    r"total (?P<state>[\d.]+)MiB"
)
SAVE = re.compile(r"checkpoint step-(\d+) saved in ([\d.]+)s, training blocked ([\d.]+)s")
LOSS = re.compile(r"step: (\d+)\s+loss: ([\d.]+)")
SAVE_STEPS_TOUCHED = 3  # steps after a save whose time the checkpoint cross-check charges to it
STEP_TPS = re.compile(r"step: (\d+)\s+loss: .*?tps: ([\d,]+)")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores (CPU)"


def command() -> str:
    return " ".join([Path(sys.executable).name, "scripts/benchmark.py", *sys.argv[1:]])


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


# ---------------------------------------------------------------- the bare loop
def bare_loop(args) -> None:
    """The same model, batch and optimizer as the trainer, written the way a user would without
    it; prints one JSON line."""
    import torch
    import torch.nn.functional as F

    from titanlite.config_sections import Metrics, Model
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.metrics import MetricsLogger
    from titanlite.metrics.profiling import peak_memory_gib
    from titanlite.models.llama import flops_per_token
    from titanlite.models.llama.args import LLAMA3_FLAVORS
    from titanlite.models.llama.model import Transformer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = build_tokenizer(Model()).vocab_size  # the trainer's model takes its vocab from this tokenizer
    torch.manual_seed(0)
    model_args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=vocab)
    model = Transformer(model_args).to(device)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=8e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=device.type == "cuda",
        foreach=device.type != "cuda",
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    data_seconds, started = 0.0, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started, data_seconds = now(), 0.0
        waited = time.perf_counter()
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1))
        inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        data_seconds += time.perf_counter() - waited
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = now() - started
    # Counted as the trainer counts them: the same FLOPs per token, peak table and memory reading.
    metrics = MetricsLogger(Metrics(), 0, device, flops_per_token(model, args.seq_len))
    tps, tflops, mfu_pct = metrics.throughput(args.steps * args.batch * args.seq_len, elapsed)
    print(
        json.dumps(
            {
                "tps": tps,
                "step": elapsed / args.steps,
                "tflops": tflops,
                "mfu": "unknown" if mfu_pct is None else f"{mfu_pct:.2f}%",
                "mem": peak_memory_gib(device),
                "data": 100 * data_seconds / elapsed,
                "loss": loss.item(),
            }
        )
    )


# ---------------------------------------------------------------- running rows
def job_flags(folder: Path, seq_len: int, batch: int, steps: int) -> list[str]:
    return [
        "--job.config_file",
        CONFIG,
        "--job.dump_folder",
        str(folder),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(batch),
        "--training.steps",
        str(steps),
    ]


def trainer_flags(args, folder: Path, extra: list[str]) -> list[str]:
    return [
        *job_flags(folder, args.seq_len, args.batch, args.warmup + args.steps),
        "--training.dataset",
        "synthetic",
        # The bare loop's attention: random tokens have no documents to mask apart (the mask rows set their own).
        "--model.attention_mask",
        "causal",
        "--training.mixed_precision_param",
        args.dtype,
        "--metrics.log_freq",
        str(args.log_freq),
        "--metrics.summary_warmup_steps",
        str(args.warmup),
        "--lr_scheduler.warmup_steps",
        "2",
        *extra,
    ]


def run(command: list[str], timeout: int) -> str:
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"benchmark: `{' '.join(command)}` failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def run_row(name: str, args, work: Path) -> dict:
    row = measure_row(name, args, work)
    print(f"  {name}: {row['tps']:,.0f} tps", file=sys.stderr, flush=True)  # progress; the table comes at the end
    return row


def measure_row(name: str, args, work: Path) -> dict:
    _, extra, procs = ROWS[name]
    if name == "bare":
        output = run(
            [
                sys.executable,
                __file__,
                "--bare-loop",
                "--seq-len",
                str(args.seq_len),
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--dtype",
                args.dtype,
            ],
            args.timeout,
        )
        return json.loads(output.strip().splitlines()[-1])
    folder = work / f"{name}-{time.monotonic_ns()}"
    if name.startswith("ckpt"):
        # log_freq 1: every step's own time, to see what a save step costs beside what the manager reports.
        extra = extra + ["--checkpoint.interval", str(args.ckpt_interval), "--metrics.log_freq", "1"]
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    output = run(launcher + ["-m", "titanlite.train", *trainer_flags(args, folder, extra)], args.timeout)
    match = SUMMARY.search(output)
    if not match:
        sys.exit(f"benchmark: no run summary line in the output of row {name}:\n{output[-3000:]}")
    row = {k: (v if k == "mfu" else float(v.replace(",", ""))) for k, v in match.groupdict().items()}
    # The last step's save is always waited for; only the saves during training say what async buys.
    last = args.warmup + args.steps
    row["saves"] = [(int(s), float(t), float(b)) for s, t, b in SAVE.findall(output) if int(s) != last]
    if name.startswith("ckpt"):
        seconds = {int(s): args.batch * args.seq_len / float(t.replace(",", "")) for s, t in STEP_TPS.findall(output)}
        # A save runs after its step's log line, so its time shows in the next steps' lines: the
        # blocking part in the next one, background work in the next few. Each save is charged
        # what those steps took beyond a step that no save touches.
        after = range(1, min(SAVE_STEPS_TOUCHED, args.ckpt_interval - 1) + 1)
        touched = {save: [save + k for k in after if save + k in seconds] for save, _, _ in row["saves"]}
        untouched = [
            t for s, t in seconds.items() if s > args.warmup and not any(s in steps for steps in touched.values())
        ]
        usual = statistics.median(untouched) if untouched else float("nan")
        row["save_step_extra"] = [sum(seconds[s] - usual for s in steps) for steps in touched.values() if steps]
    return row


def median_row(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in ("tps", "step", "tflops", "mem", "data"):
        best[key] = statistics.median(r[key] for r in runs)
    best["runs"] = [r["tps"] for r in runs]
    return best


def table(results: dict[str, dict]) -> str:
    bare = results.get("bare")
    lines = [
        "| row | what | tps | step (s) | TFLOP/s | MFU | peak memory (GiB) | data wait | vs bare |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        # Rows that do more work per step (checkpoint saves), read other data or run on more ranks have no fair ratio.
        comparable = name != "bare" and ROWS[name][2] == 1 and not name.startswith(("ckpt", "mask"))
        ratio = f"{r['tps'] / bare['tps']:.3f}" if bare and comparable else ""
        runs = f" ({', '.join(f'{t:,.0f}' for t in r['runs'])})" if len(r.get("runs", [])) > 1 else ""
        lines.append(
            f"| {name} | {ROWS[name][0]} | {r['tps']:,.0f}{runs} | {r['step']:.4f} | {r['tflops']:.3f} | {r['mfu']} | "
            f"{r['mem']:.3f} | {r['data']:.2f}% | {ratio} |"
        )
    return "\n".join(lines)


def sharded_memory_line(results: dict[str, dict], name: str) -> str:
    """The 2-rank row's state per rank against the unsharded run's: about half for FSDP2, TP2 and PP2
    (PP: rank 0's stage, the embedding and the first half of the blocks)."""
    whole, sharded = results["titanlite"], results[name]
    share = sharded["state"] / whole["state"]
    verdict = "within" if share <= 1.05 / 2 else "ABOVE"
    return (
        f"{ {'fsdp2': 'FSDP', 'tp2': 'TP', 'pp2': 'PP'}[name] } memory: params + grads + optimizer state per rank "
        f"{sharded['state']:.3f} MiB over 2 ranks vs "
        f"{whole['state']:.3f} MiB unsharded = {share:.4f} of it ({verdict} the 1.05/N = {1.05 / 2:.3f} bound)"
    )


def checkpoint_line(results: dict[str, dict]) -> str:
    sync, asyn = results["ckpt_sync"]["saves"], results["ckpt_async"]["saves"]
    if not sync or not asyn:
        return "checkpoint: no save during training; raise --steps or lower --ckpt-interval"
    sync_blocked = statistics.mean(b for _, _, b in sync)
    async_blocked = statistics.mean(b for _, _, b in asyn)
    async_total = statistics.mean(t for _, t, _ in asyn)
    share = async_blocked / sync_blocked
    verdict = "within" if share <= 0.05 else "ABOVE"
    extra = {
        name: statistics.mean(results[name]["save_step_extra"] or [float("nan")])
        for name in ("ckpt_sync", "ckpt_async")
    }
    return (
        f"checkpoint: a synchronous save blocks training {sync_blocked:.3f}s; an async save of the same state "
        f"blocks it {async_blocked:.3f}s (and completes in the background in {async_total:.3f}s) = "
        f"{100 * share:.1f}% of the synchronous block ({verdict} the 5% bound); saves during training: "
        f"{len(sync)} sync, {len(asyn)} async (as CheckpointManager reports them)\n"
        f"checkpoint cross-check: the {SAVE_STEPS_TOUCHED} steps after a save took {extra['ckpt_sync']:+.3f}s (sync) "
        "and "
        f"{extra['ckpt_async']:+.3f}s (async) longer in all than steps no save touches"
    )


def benchmark(args) -> None:
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"benchmark: unknown rows {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if {"fsdp2", "tp2", "pp2"} & set(names) and "titanlite" not in names:
        names.insert(0, "titanlite")  # the unsharded numbers the FSDP, TP and PP rows are compared with
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now()
    print(f"# titanlite benchmark, {started:%Y-%m-%d %H:%M}")
    print(
        f"device: {device_name()}; torch {__import__('torch').__version__}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print(
        f"job: llama3 debugmodel, seq {args.seq_len}, batch {args.batch}, {args.dtype}, synthetic data, "
        f"{args.steps} steps timed after {args.warmup} warm-up steps; {load()} at start"
    )
    print(f"command: {command()}", flush=True)
    busy_at_start = os.getloadavg()[0] > 0.5 * os.cpu_count()
    results: dict[str, list[dict]] = {}
    # Bare and titanlite alternate, so both see the same machine; the other rows run once each.
    paired = [n for n in ("bare", "titanlite") if n in names]
    for _ in range(args.repeats):
        for name in paired:
            results.setdefault(name, []).append(run_row(name, args, work))
    for name in names:
        if name not in paired:
            results[name] = [run_row(name, args, work)]
    merged = {name: median_row(results[name]) for name in names}
    print()
    print(table(merged))
    print()
    if "bare" in merged and "titanlite" in merged:
        ratio = merged["titanlite"]["tps"] / merged["bare"]["tps"]
        print(
            f"overhead: titanlite runs at {ratio:.3f} x the bare loop's tokens/s ({100 * (1 - ratio):+.1f}% overhead; "
            f"medians of {args.repeats} alternating runs each)"
        )
        if busy_at_start:
            # Two intra-op threads on cores that other processes also want spin at every barrier: the same
            # step was seen to take from 0.27 s to 4.4 s here, so a ratio taken on a busy machine says little.
            print(
                "the machine was busy at the start (load average above half the cores): other processes slow the "
                "runs unevenly; repeat the ratio on a quiet machine (or with OMP_NUM_THREADS=1 for both)"
            )
    for name in ("fsdp2", "tp2", "pp2"):
        if name in merged:
            print(sharded_memory_line(merged, name))
    if "ckpt_sync" in merged and "ckpt_async" in merged:
        print(checkpoint_line(merged))
    if "mask_causal" in merged and "mask_block_causal" in merged:
        ratio = merged["mask_block_causal"]["tps"] / merged["mask_causal"]["tps"]
        print(
            f"attention mask: block_causal runs at {ratio:.3f} x causal's tokens/s on the same packed documents "
            "(MFU counts the same attention FLOPs for both: the mask's skipped scores are not discounted)"
        )
    print(f"{load()} at the end; took {(datetime.datetime.now() - started).total_seconds():.0f}s")


# ---------------------------------------------------------------- the token-store loader
LOADER_ROWS = ((2048, 8, 0), (256, 8, 0), (2048, 8, 2))  # (seq_len, local batch, training.num_workers)


def loader_throughput(args) -> None:
    """--loader: tokens/s that one process's loader delivers from a token store (the sample corpus
    prepared into <work-dir>/sample_store), with no model: what it could feed a training step."""
    from titanlite.data.datasets import DataSpec, build_dataloader
    from titanlite.data.prepare import prepare
    from titanlite.data.store import is_store
    from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer

    store = Path(args.work_dir) / "sample_store"
    if not is_store(store, "--work_dir"):
        prepare("sample", str(store), workers=1)
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER)
    print(f"# token-store loader, {datetime.datetime.now():%Y-%m-%d %H:%M}; device: {device_name()}; {load()}")
    print(f"command: {command()}")
    print("| loader | tokens/s per process |\n|---|---:|")
    for seq_len, batch, workers in LOADER_ROWS:
        loader = build_dataloader(
            DataSpec("sample", str(store), seq_len, batch, num_workers=workers), tokenizer, 0, 1, 0
        )
        batches = iter(loader)
        next(batches)  # start-up (worker processes, the first epoch's order) is not the steady rate
        tokens, began = 0, time.perf_counter()
        while time.perf_counter() - began < args.loader_seconds:
            inputs, _ = next(batches)
            tokens += inputs.numel()
        rate = tokens / (time.perf_counter() - began)
        print(f"| token store, seq {seq_len}, batch {batch}, {workers} workers | {rate:,.0f} |", flush=True)


# ---------------------------------------------------------------- precision curves
def precision_curves(args) -> None:
    """fp32 AdamW vs pure bf16 weights with AdamWBF16Kahan vs pure bf16 weights with plain AdamW,
    trained on the sample corpus from the same initial weights and data."""
    work = Path(args.work_dir)
    runs = {
        "fp32 AdamW": ["--training.mixed_precision_param", "float32"],
        "bf16 AdamWBF16Kahan": ROWS["bf16_kahan"][1],
        "bf16 AdamW (no compensation)": PURE_BF16,
    }
    print(f"# titanlite pure-bf16 check, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(
        f"device: {device_name()}; llama3 debugmodel on the sample corpus, seq {args.seq_len}, batch {args.batch}, "
        f"{args.steps} steps, lr 8e-4 with 2 warm-up steps and linear decay to 0.1x"
    )
    print(f"command: {command()}", flush=True)
    curves = {}
    for name, extra in runs.items():
        flags = [
            *job_flags(work / f"precision-{time.monotonic_ns()}", args.seq_len, args.batch, args.steps),
            "--metrics.log_freq",
            "1",
            *extra,
        ]
        output = run([sys.executable, "-m", "titanlite.train", *flags], args.timeout)
        curves[name] = {int(s): float(v) for s, v in LOSS.findall(output)}
    reference = curves["fp32 AdamW"]
    steps = sorted(reference)
    last = steps[-max(1, len(steps) // 5) :]
    print()
    print("| run | final loss | mean abs gap to fp32, all steps | mean abs gap, last 20% of steps |")
    print("| --- | ---: | ---: | ---: |")
    for name, curve in curves.items():
        gap_all = statistics.mean(abs(curve[s] - reference[s]) for s in steps)
        gap_last = statistics.mean(abs(curve[s] - reference[s]) for s in last)
        print(f"| {name} | {curve[steps[-1]]:.4f} | {gap_all:.4f} | {gap_last:.4f} |")
    every = max(1, len(steps) // 10)
    print()
    print("step  " + "  ".join(f"{name:>28}" for name in curves))
    for s in steps[::every] + ([steps[-1]] if steps[-1] not in steps[::every] else []):
        print(f"{s:4d}  " + "  ".join(f"{curves[name][s]:28.4f}" for name in curves))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=None, help="alternating runs of bare and titanlite")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--log-freq", type=int, default=10, help="the trainer's metrics.log_freq")
    parser.add_argument("--ckpt-interval", type=int, default=None)
    parser.add_argument("--short", action="store_true", help="tiny and quick: for the test suite")
    parser.add_argument("--precision", action="store_true", help="the pure-bf16 loss-curve comparison instead")
    parser.add_argument("--work-dir", default=str(ROOT / "outputs" / "benchmark"))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--loader", action="store_true", help="the token-store loader's tokens/s instead (no model)")
    parser.add_argument("--loader-seconds", type=float, default=3.0, help="seconds each --loader row reads")
    parser.add_argument("--bare-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.short:
        args.rows = args.rows if args.rows != DEFAULT_ROWS else SHORT_ROWS
        args.seq_len, args.batch = min(args.seq_len, 64), min(args.batch, 2)
    defaults = {
        "steps": 4 if args.short else (100 if args.precision else 30),
        "warmup": 1 if args.short else 5,
        "repeats": 1 if args.short else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ckpt_interval is None:
        args.ckpt_interval = max(2, (args.warmup + args.steps) // 4)
    if args.bare_loop:
        bare_loop(args)
    elif args.precision:
        precision_curves(args)
    elif args.loader:
        loader_throughput(args)
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
