"""Steps per hour of rl.generator_ranks 1 at rl.max_staleness 1 against 0 (docs/benchmarks.md, "GRPO rollouts"):

    PYTHONPATH=$PWD python tests/generator_ranks_speed.py OUT_FOLDER PAIRS STEPS MAX_NEW_TOKENS

2 processes, one thread each: PAIRS runs of 1 trainer + 1 generator rank alternating K = 0, 1, 0, 1, ... in one
launch of tests/layout_runs.py, then the colocated 2-rank K = 0 run in a second; each run 2 prompts x 8 completions
of up to MAX_NEW_TOKENS tokens per step. Prints each run's seconds per step (the run summary's mean over the second
half of the steps) and its mean rl/generate_seconds and rl/weight_sync_seconds over those steps.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import DEBUG_CONFIG, ON_CPU, ROOT, tensorboard_scalars


def flags(out: Path, name: str, steps: int, new_tokens: int, *extra: str) -> list[str]:
    return [
        *ON_CPU,
        *("--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(out / name)),
        *("--training.dataset_format", "prompts", "--training.dataset_path", str(out / "prompts.jsonl")),
        *("--training.seq_len", "128", "--training.steps", str(steps), "--training.local_batch_size", "8"),
        *("--training.global_batch_size", "16", "--rl.num_generations", "8", "--rl.max_new_tokens", str(new_tokens)),
        *("--rl.reward_functions", "tests/grpo_rewards.py:letter_share", "--training.mixed_precision_param", "float32"),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "--metrics.summary_warmup_steps", str(steps // 2)),
        *extra,
    ]


def launch(out: Path, name: str, runs: list[list[str]]) -> list[float]:
    """The runs in one 2-process launch; each one's seconds per step from its run summary, in order."""
    spec = out / f"{name}.json"
    spec.write_text(json.dumps([{"argv": argv} for argv in runs]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(ROOT / "tests" / "layout_runs.py"), str(spec)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    log = done.stdout + done.stderr
    (out / f"{name}.log").write_text(log)
    assert done.returncode == 0, log[-3000:]
    return [float(s) for s in re.findall(r"run summary: \d+ steps after \d+ warm-up .*? step: ([\d.]+)s", log)]


def mean_after(folder: Path, tag: str, first: int) -> float:
    values = [v for step, v in tensorboard_scalars(folder / "tb", tag).items() if step >= first]
    return sum(values) / len(values)


def main(out: str, pairs: str, steps: str, new_tokens: str) -> None:
    out, pairs, steps, new_tokens = Path(out), int(pairs), int(steps), int(new_tokens)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Question {i}: say eeee"}) + "\n" for i in range(200))
    )
    names = [f"k{k}_{pair}" for pair in range(pairs) for k in (0, 1)]
    generator = [
        flags(out, name, steps, new_tokens, "--rl.generator_ranks", "1", "--rl.max_staleness", name[1])
        for name in names
    ]
    seconds = dict(zip(names, launch(out, "generator", generator)))
    seconds["colocated_k0"] = launch(out, "colocated", [flags(out, "colocated_k0", steps, new_tokens)])[0]
    for name, per_step in seconds.items():
        generate = mean_after(out / name, "rl/generate_seconds", steps // 2 + 1)
        sync = mean_after(out / name, "rl/weight_sync_seconds", steps // 2 + 1) if name != "colocated_k0" else 0.0
        print(f"{name}: {per_step:.3f} s/step, rl/generate_seconds {generate:.3f}, rl/weight_sync_seconds {sync:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
