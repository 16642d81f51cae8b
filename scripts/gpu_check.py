"""Everything a CPU cannot show, on one GPU (issue 17): the test suite with its cuda tier, and the
benchmark rows of the issue's table at its shape (Llama 3.2 1B, seq 8192, synthetic tokens).

    python3 scripts/gpu_check.py OUT_DIR ITEM [ITEM ...]   items: groups (tests cuda table offload shapes
                                                          attention saves) or single runs (compile, best, ...)
    python3 scripts/gpu_check.py --list                    every run of every group, with its flags

Each group is sized, from issue 17's timings, for one 10-minute command of the lent GPU (see
shared/GPU.md: carry the wheels, set PYTHONPATH); `cuda`, `compile` and `best` ran on one H100 on
2026-11-26 (docs/benchmarks.md "First GPU run"). Put runs before test groups in one command: a test
group's leftover processes would share the machine with the runs timed after it. Each run writes OUT_DIR/NAME.log; after
each group OUT_DIR/gpu_check.json and
gpu_check.md hold the run summary figures of every log present so far, next to the planner's
prediction for the run (the trainer logs both on CUDA). tests/test_gpu_check.py checks on the CPU
that every run's flags form a valid job, so no GPU minute is lost to a typo.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/llama3_1b.toml"
# The runs: synthetic tokens under plain causal attention (cuDNN's kernel through SDPA; random
# tokens would make block_causal cut windows at random bos ids), no AC, no compile, no float8 unless a
# row says so. The shipped tokenizer: nothing to download. 30 steps, the first 10 left out of the summary.
COMMON = [
    "--model.tokenizer_path=",
    "--training.dataset",
    "synthetic",
    "--model.attention_mask",
    "causal",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "8192",
    "--training.steps",
    "30",
    "--metrics.log_freq",
    "10",
    "--metrics.summary_warmup_steps",
    "10",
    "--metrics.enable_tensorboard",
    "false",
    "--activation_checkpoint.mode",
    "none",
    "--compile.enable",
    "false",
    "--float8.enable",
    "false",
    "--float8.enable_fsdp_float8_all_gather",
    "false",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
    "false",
    "--plan.nodes",
    "1",
    "--plan.gpus_per_node",
    "1",
]
COMPILE = ["--compile.enable"]
OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
FLOAT8 = ["--float8.enable", "--float8.recipe_name", "tensorwise"]
BATCH_1 = ["--training.local_batch_size", "1"]
OFFLOAD = ["--activation_checkpoint.offload_activations"]
LOSS_CHUNKS = ["--training.loss_chunk_tokens", "4096"]
SAMPLE = ["--training.dataset", "sample"]
BLOCK_CAUSAL = ["--model.attention_mask", "block_causal"]
LAYERS_8B = ["--model.flavor", "8B", "--model.n_layers", "8", "--training.local_batch_size", "1"]
SAVES = [
    "--training.steps",
    "40",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "10",
    "--profiling.enable_memory_snapshot",
    "--profiling.profile_freq",
    "20",
]

GROUPS: dict[str, dict[str, list[str]]] = {
    "table": {  # the table, row by row
        "eager": [],  # OOMed by fragmentation before titanlite set expandable_segments itself
        "compile": COMPILE,
        "compile_ac_op": COMPILE + OP_AC,
        "float8_tensorwise": COMPILE + FLOAT8,
        "float8_rowwise": COMPILE + ["--float8.enable", "--float8.recipe_name", "rowwise"],
        "bf16_kahan": COMPILE
        + [
            "--training.param_dtype",
            "bfloat16",
            "--training.mixed_precision_param",
            "bfloat16",
            "--optimizer.name",
            "AdamWBF16Kahan",
        ],
    },
    "offload": {  # batch 1 as the issue ran it; target: offload at most 1.3x slower than without
        "eager_b1": BATCH_1,
        "offload_eager_b1": BATCH_1 + OFFLOAD,
        "compile_b1": BATCH_1 + COMPILE,
        "offload_compile_b1": BATCH_1 + COMPILE + OFFLOAD,
        # The chunked output loss (training.loss_chunk_tokens): its speed beside compile_b1, and the
        # batch its memory buys beside `best` (the planner, counting eagerly, fits batch 10 with op AC).
        "loss_chunks_b1": BATCH_1 + COMPILE + LOSS_CHUNKS,
        "best_loss_chunks": COMPILE + FLOAT8 + OP_AC + LOSS_CHUNKS + ["--training.local_batch_size", "6"],
    },
    "shapes": {
        "best": COMPILE + FLOAT8 + OP_AC + ["--training.local_batch_size", "4"],  # target 66% MFU
        "8b_layers_compile": COMPILE + LAYERS_8B,  # target 60% MFU
        "8b_layers_float8": COMPILE + FLOAT8 + LAYERS_8B,
    },
    "attention": {  # inside documents (FlexAttention) against causal (cuDNN), on packed real text
        "sample_causal": COMPILE + SAMPLE,
        "sample_block_causal": COMPILE + SAMPLE + BLOCK_CAUSAL,
        # Eager selective op AC runs each block under a dispatch mode, which dynamo does not compile
        # under: does FlexAttention stay compiled there, or fall back to its unfused path (the whole
        # score matrix, about 17 GB per layer at this shape)?
        "sample_block_causal_eager_op_ac": OP_AC + SAMPLE + BLOCK_CAUSAL,
    },
    "saves": {  # training time lost per save of the 1B state; target at most 1 s for the async pinned save
        "save_sync": COMPILE + SAVES + ["--checkpoint.async_mode", "disabled"],
        "save_async_pinned": COMPILE + SAVES + ["--checkpoint.async_mode", "async_with_pinned_mem"],
    },
}
RUNS = {name: flags for group in GROUPS.values() for name, flags in group.items()}

FIGURES = {  # name -> pattern in the run summary lines (profiling.RunSummary)
    "tps": r"run summary: .*?tps: ([\d,]+)",
    "mfu_pct": r"run summary: .*?mfu: ([\d.]+)%",
    "peak_memory_gib": r"run summary: .*?peak_memory: ([\d.]+)GiB",
    "predicted_peak_gib": r"predicted vs measured: peak_memory ([\d.]+)GiB",
    "predicted_tps": r"predicted vs measured: .*?tps ([\d,]+) vs",
    "checkpoint_lost_s": r"training lost ([\d.]+)s",
    "offload_held_gib": r"activation_offload: peak ([\d.]+)GiB",
}


def planner_gpu(device_name: str) -> str:
    """The planner's name (titanlite/plan/hardware.py) for the GPU torch reports."""
    if "H200" in device_name:
        return "H200"
    return "H100 PCIe" if "PCIe" in device_name else "H100 SXM"


def job_arguments(name: str, out: Path, gpu: str) -> list[str]:
    """The trainer's arguments for run `name`: later flags override earlier ones."""
    return ["--job.config_file", CONFIG, *COMMON, "--plan.gpu", gpu, *RUNS[name], "--job.dump_folder", str(out / name)]


def summary_figures(log: str) -> dict[str, float | None]:
    """Each figure of FIGURES found in the log (None where the run did not print it)."""
    found = {}
    for name, pattern in FIGURES.items():
        match = re.search(pattern, log)
        found[name] = float(match.group(1).replace(",", "")) if match else None
    return found


def markdown(results: dict[str, dict]) -> str:
    lines = ["| run | " + " | ".join(FIGURES) + " |", "| --- |" + " ---: |" * len(FIGURES)]
    for run, figures in results.items():
        cells = ["" if figures[name] is None else f"{figures[name]:,.2f}" for name in FIGURES]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path) -> str:
    """gpu_check.json and gpu_check.md from every run's log present in `out`, in RUNS order."""
    results = {
        name: summary_figures((out / f"{name}.log").read_text()) for name in RUNS if (out / f"{name}.log").exists()
    }
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out / "gpu_check.md").write_text(table)
    return table


TEST_GROUPS = {  # name -> pytest's selection
    "tests": [],  # the whole suite: it must pass on a machine with a GPU too (5+ minutes on one H100 with 16 cores)
    "cuda": ["-m", "cuda"],  # the cuda tier alone (about 2 minutes there)
}


def run_tests(group: str, out: Path) -> None:
    with open(out / f"{group}.log", "w") as log:
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-n",
                "8",
                "-v",
                "-p",
                "no:cacheprovider",
                "-rfEs",
                *TEST_GROUPS[group],
                "tests",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    print(f"{group}: {'passed' if code == 0 else f'FAILED (exit {code}), see {out}/{group}.log'}", flush=True)


RUN_TIMEOUT_S = 240  # a run takes about a minute; a hung one must not take the group's whole command with it


def train(name: str, out: Path, gpu: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "titanlite.train",
        *job_arguments(name, out, gpu),
    ]
    with open(out / f"{name}.log", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        run = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        try:
            code = run.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: torchrun runs its worker in a session of its own, and only torchrun
            # itself, on SIGTERM, stops it (SIGTERM, then SIGKILL after 30 s) and so frees the GPU.
            run.terminate()
            run.wait()
            code = f"timed out after {RUN_TIMEOUT_S} s"
    print(f"{name}: {'done' if code == 0 else f'FAILED ({code}), see {out}/{name}.log'}", flush=True)


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        for group, runs in GROUPS.items():
            for name, flags in runs.items():
                print(f"{group}\t{name}\t{' '.join(flags)}")
        return 0
    items = argv[1:]
    if not items or any(item not in (*TEST_GROUPS, *GROUPS, *RUNS) for item in items):
        print(
            "usage: python3 scripts/gpu_check.py OUT_DIR ITEM [ITEM ...] (groups: "
            f"{' '.join([*TEST_GROUPS, *GROUPS])}; "
            "or run names, see --list) | --list",
            file=sys.stderr,
        )
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check.py: no CUDA GPU is visible (torch.cuda.is_available() is false); run it on a GPU machine",
            file=sys.stderr,
        )
        return 1
    device_name = torch.cuda.get_device_name()
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {device_name}, torch {torch.__version__}; results in {out}", flush=True)
    for item in items:
        if item in TEST_GROUPS:
            run_tests(item, out)
            continue
        for name in GROUPS.get(item, [item]):
            train(name, out, planner_gpu(device_name))
        print(write_report(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
