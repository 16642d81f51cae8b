"""Generation speed of titanlite (titanlite.load's LM: static KV cache, decode loop) against transformers' generate,
in-process on the same random fp32 Llama folder, greedy, every new token made (no eos stops either side).

    python scripts/benchmark_generate.py [--batches 1,8] [--new-tokens 128] [--pairs 3] [--threads 1]
                                         [--compiled] [--write docs/benchmarks.md]

For each batch size: batch 1 is one 32-token prompt; larger batches alternate prompts of 32 and 64 tokens
(left-padded). Each comparison runs one warm-up pair, then --pairs pairs, the two sides' order alternating from
pair to pair so that a machine that gets busier meanwhile slows both; every pair is printed, and the speed-up is the
median of the pairs' ratios (every pair's ratio shown). The greedy tokens of both sides are checked to be the same.

Comparisons: titanlite eager against transformers' default generate (its dynamic cache); with --compiled also
titanlite's compiled decode step (compile=True) against that default and against transformers' static cache with
its forward compiled (torch.compile, default mode), the compilation paid in the warm-up pair. --write replaces the generated rows of
that file's generation section (between its <!-- generate rows --> markers) with this run's, with the device,
versions, date and command.
"""

import argparse
import datetime
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import titanlite  # noqa: E402
from titanlite.data.chat_example import write_tokenizer_folder  # noqa: E402
from titanlite.inference.decode import Sampling  # noqa: E402
from titanlite.inference.prompts import Prompt  # noqa: E402

CONFIG = dict(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
MARKERS = ("<!-- generate rows -->", "<!-- /generate rows -->")


def prompt_lengths(batch: int) -> list[int]:
    return [32] if batch == 1 else [64 if row % 2 else 32 for row in range(batch)]


def paired(first, second, pairs: int) -> list[tuple[float, float]]:
    """(first's seconds, second's seconds) of each pair after one warm-up pair, the order alternating."""
    times = []
    for number in range(pairs + 1):
        order = [(0, first), (1, second)] if number % 2 == 0 else [(1, second), (0, first)]
        seconds = [0.0, 0.0]
        for side, run in order:
            started = time.perf_counter()
            run()
            seconds[side] = time.perf_counter() - started
        if number:
            times.append((seconds[0], seconds[1]))
    return times


def compare(label: str, ours, theirs, batch: int, new_tokens: int, pairs: int) -> tuple[str, float]:
    """Print each pair and the median speed-up; returns (the summary line, the median)."""
    times = paired(ours, theirs, pairs)
    ratios = [t / o for o, t in times]
    tokens = batch * new_tokens
    for number, ((o, t), ratio) in enumerate(zip(times, ratios), 1):
        print(f"  {label}, batch {batch}, pair {number}: titanlite {o:.3f}s ({tokens / o:.0f} tok/s), "
              f"transformers {t:.3f}s ({tokens / t:.0f} tok/s): {ratio:.2f}x")
    median = statistics.median(ratios)
    o, t = statistics.median(o for o, _ in times), statistics.median(t for _, t in times)
    row = (f"| {label} | {batch} | {', '.join(map(str, sorted(set(prompt_lengths(batch)))))} | {tokens / o:.0f} | "
           f"{tokens / t:.0f} | **{median:.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} |")
    print(f"{label}, batch {batch}: median {median:.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)})")
    return row, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="also compare the compiled paths")
    parser.add_argument("--write", default="", help="markdown file whose generation rows this run replaces")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    folder = Path(tempfile.mkdtemp())
    try:
        torch.manual_seed(0)
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
        theirs.save_pretrained(folder)
        theirs.generation_config.eos_token_id = None  # every new token made, as on titanlite's side
        tokenizer = write_tokenizer_folder(folder / "tokenizer")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, folder / name)
        eager = titanlite.load(folder, device="cpu")
        comparisons = [("eager vs default", eager, theirs, {})]
        if args.compiled:
            compiled = titanlite.load(folder, compile=True, device="cpu")
            static = transformers.LlamaForCausalLM.from_pretrained(folder).float().eval()
            static.generation_config.eos_token_id = None
            static.forward = torch.compile(static.forward)
            comparisons += [("compiled vs default", compiled, theirs, {}),
                            ("compiled vs static + compile", compiled, static, {"cache_implementation": "static"})]
        print(f"CPU ({platform.processor() or platform.machine()}), {args.threads} thread(s), torch {torch.__version__}, "
              f"transformers {transformers.__version__}; Llama {CONFIG['num_hidden_layers']} layers dim "
              f"{CONFIG['hidden_size']} vocab {CONFIG['vocab_size']}, {args.new_tokens} new tokens, greedy fp32, "
              f"median of {args.pairs} alternated pairs after a warm-up pair")
        load = f"{os.getloadavg()[0]:.1f}"
        rows = []
        for batch in map(int, args.batches.split(",")):
            generator = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(3, CONFIG["vocab_size"], (length,), generator=generator).tolist()
                       for length in prompt_lengths(batch)]
            width = max(map(len, prompts))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            attention_mask = torch.arange(width)[None] >= width - torch.tensor([len(p) for p in prompts])[:, None]
            sampling = Sampling(args.new_tokens, stop_ids=())
            for label, lm, model, options in comparisons:
                results = {}

                def run_titanlite():
                    results["titanlite"] = [c.token_ids for c in lm.complete([Prompt("", p) for p in prompts], sampling)]

                def run_transformers():
                    with torch.no_grad():
                        out = model.generate(input_ids=input_ids, attention_mask=attention_mask.long(), do_sample=False,
                                             pad_token_id=0, max_new_tokens=args.new_tokens, **options)
                    results["transformers"] = out[:, width:].tolist()

                row, _ = compare(label, run_titanlite, run_transformers, batch, args.new_tokens, args.pairs)
                same = results["titanlite"] == results["transformers"]
                print(f"  same greedy tokens: {same}")
                rows.append(row + (" yes |" if same else " **no** |"))
        load += f" to {os.getloadavg()[0]:.1f}"
        print(f"load average (1 minute) {load}: other processes on the machine slow both sides unevenly")
        if args.write:
            write_rows(Path(args.write), rows, args.threads, load)
    finally:
        shutil.rmtree(folder)


def write_rows(path: Path, rows: list[str], threads: int, load: str) -> None:
    """The rows, under a line naming the device, versions, date, the machine's load and the command, between the
    file's markers."""
    import transformers

    command = "python " + shlex.join(["scripts/benchmark_generate.py", *sys.argv[1:]])
    header = (f"{datetime.date.today()}, CPU ({platform.machine()}, {os.cpu_count()} cores, {threads} thread(s) used, "
              f"load average {load} during the run), torch {torch.__version__}, transformers {transformers.__version__}: "
              f"`{command}`\n\n"
              "| titanlite vs transformers | batch | prompt tokens | titanlite tok/s | transformers tok/s | speed-up (median) | pairs | "
              "same tokens |\n|---|---|---|---|---|---|---|---|\n")
    text = path.read_text()
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    path.write_text(text[:start] + "\n" + header + "\n".join(rows) + "\n" + text[end:])


if __name__ == "__main__":
    main()
