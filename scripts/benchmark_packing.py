"""Chat fine-tuning with conversations packed (training.packing, the default) against one conversation per window
(training.packing false): trained tokens per second of the debug Qwen3 on a Qwen-style (ChatML, no bos) chat set.

    python scripts/benchmark_packing.py [--conversations 2000] [--seq_len 512] [--batch 4] [--steps 12] [--warmup 3]
                                        [--pairs 3] [--threads 1] [--work-dir DIR]

The set: conversations of 50-150 tokens (a user question and an assistant answer cut from the sample corpus), rendered
with the ChatML template of the chat example's tokenizer, which writes no bos. Each run is `python -m titanlite.train`
as a user runs it, measured by its own `run summary:` line (the mean step after --warmup steps) and its step lines'
trained-token counts: trained tokens per second = the counted steps' trained tokens per step / the mean step. The
runs go in pairs, packed and unpacked in alternating order, so a machine that gets busier slows both; every pair is
printed and the speed-up is the median of the pairs' ratios. Take the bench lock (/work/wt/notes/bench.lock or the
machine's own) before running it on a shared machine.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
print = functools.partial(print, flush=True)  # each line as it comes, through a pipe too
sys.path.insert(0, str(ROOT))

from titanlite.data.sample_corpus import sample_documents  # noqa: E402
from titanlite.examples.chat_example import paragraphs, write_tokenizer_folder  # noqa: E402

SHORTEST, LONGEST = 50, 150  # tokens of a rendered conversation


def rendered_length(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def write_chats(folder: Path, count: int, seed: int = 0) -> tuple[Path, list[int]]:
    """`count` ChatML conversations of SHORTEST-LONGEST tokens as chats.jsonl; returns its path and their lengths."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    texts = [p for document in sample_documents() for p in paragraphs(document) if len(p.split()) >= 40]
    rng = np.random.default_rng(seed)
    records, lengths = [], []
    while len(records) < count:
        words = texts[rng.integers(len(texts))].split()
        target, start = int(rng.integers(SHORTEST, LONGEST + 1)), int(rng.integers(0, len(words) - 8))
        question = {"role": "user", "content": f"Tell me about {' '.join(words[start : start + 3])}."}
        around = rendered_length(tokenizer, [question, {"role": "assistant", "content": ""}])
        answer = tokenizer(" ".join(words[start:]), add_special_tokens=False)["input_ids"][: max(target - around, 1)]
        messages = [question, {"role": "assistant", "content": tokenizer.decode(answer).strip()}]
        length = rendered_length(tokenizer, messages)
        if SHORTEST <= length <= LONGEST:
            records.append({"messages": messages})
            lengths.append(length)
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path, lengths


def train(folder: Path, data: Path, args, packing: bool) -> dict:
    """One run; returns its mean step, trained tokens per step and trained tokens per second."""
    argv = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.device",
        "cpu",
        "--job.dump_folder",
        str(folder / "dump"),
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel",
        "--model.hf_assets_path",
        str(folder / "tokenizer"),
        "--training.dataset_path",
        str(data),
        "--training.dataset_format",
        "chat",
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.batch),
        "--training.steps",
        str(args.steps),
        "--training.packing",
        str(packing).lower(),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.summary_warmup_steps",
        str(args.warmup),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {'packed' if packing else 'unpacked'} run failed:\n{out.stderr[-3000:]}")
    trained = {
        int(step): int(count.replace(",", ""))
        for step, count in re.findall(r"step: +(\d+) .*trained: ([\d,]+)", out.stderr)
    }
    step = float(re.search(r"run summary: .* step: ([\d.]+)s", out.stderr).group(1))
    fill = re.search(r"the windows are (\d+)% full", out.stderr).group(1)
    per_step = statistics.mean(trained[s] for s in range(args.warmup + 1, args.steps + 1))
    return {"step": step, "trained_per_step": per_step, "tps": per_step / step, "fill": int(fill)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="packing-bench-") as scratch:
        return measure(Path(args.work_dir or scratch), args)


def measure(work: Path, args) -> int:
    write_tokenizer_folder(work / "tokenizer")
    data, lengths = write_chats(work, args.conversations)
    print(
        f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s) "
        f"per run), torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"command: python scripts/benchmark_packing.py {shlex.join(sys.argv[1:])}")
    print(
        f"data: {len(lengths)} ChatML conversations of {min(lengths)}-{max(lengths)} tokens (mean "
        f"{statistics.mean(lengths):.0f}); "
        f"debug Qwen3, seq_len {args.seq_len}, local batch {args.batch}, fp32, steps {args.warmup + 1}-{args.steps} "
        "timed"
    )
    ratios = []
    for number in range(1, args.pairs + 1):
        order = (True, False) if number % 2 else (False, True)
        runs = {packing: train(work, data, args, packing) for packing in order}
        ratios.append(runs[True]["tps"] / runs[False]["tps"])
        sides = ";  ".join(
            f"{'packed' if p else 'unpacked'} {r['tps']:,.0f} trained tok/s ({r['trained_per_step']:,.0f} "
            f"per step of {r['step']:.3f} s, windows {r['fill']}% full)"
            for p, r in runs.items()
        )
        print(f"pair {number}: {sides}: {ratios[-1]:.2f}x")
    print(
        f"packed / unpacked trained tokens per second: median {statistics.median(ratios):.2f}x "
        f"(pairs {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
