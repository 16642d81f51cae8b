"""Generation speed of titanlite (titanlite.load's LM: static KV cache, decode loop) against transformers' generate,
in-process on the same random fp32 Llama folder, greedy, every new token made (no eos stops either side).

    python scripts/benchmark_generate.py [--batches 1,8] [--new-tokens 128] [--pairs 3] [--threads 1]
                                         [--compiled] [--write docs/benchmarks.md]

For each batch size: batch 1 is one 32-token prompt; larger batches alternate prompts of 32 and 64 tokens
(left-padded). Each comparison runs one warm-up pair, then --pairs pairs, the two sides' order alternating from
pair to pair so that a machine that gets busier meanwhile slows both; every pair is printed, and the speed-up is the
median of the pairs' ratios (every pair's ratio shown). The greedy tokens of both sides are checked to be the same.

Comparisons: titanlite eager against transformers' default generate (its dynamic cache); with --compiled also
titanlite's compiled token step (compile=True) against that default and against transformers' static cache with
its forward compiled (torch.compile, default mode), the compilation paid in the warm-up pair.

With --bandwidth, a ~100M-parameter Llama (12 layers, dim 768, vocabulary 16384) decodes 128 tokens at batch 1
with the compiled step, against this machine's memory-bandwidth limit: one thread's copy bandwidth (bytes read and
written per second, STREAM's Copy, over 512 MB: 16x the L3 cache) over the bytes of weights one token reads (every
parameter but the token embedding, of which one row is read). Each pair times the copy and the decode back to
back; printed are each pair's fraction of the limit, their median, and for reference a plain sweep of F.linear over
the same weights (what reading the weights once reaches).

--write appends this run's rows to that file's generation section (after its <!-- generate rows --> marker), with
the device, versions, date, the machine's load and the command.
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
from titanlite.examples.chat_example import write_tokenizer_folder  # noqa: E402
from titanlite.inference.decode import Sampling  # noqa: E402
from titanlite.inference.prompts import Prompt  # noqa: E402

CONFIG = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
HUNDRED_M = dict(
    vocab_size=16384,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
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
        print(
            f"  {label}, batch {batch}, pair {number}: titanlite {o:.3f}s ({tokens / o:.0f} tok/s), "
            f"transformers {t:.3f}s ({tokens / t:.0f} tok/s): {ratio:.2f}x"
        )
    median = statistics.median(ratios)
    o, t = statistics.median(o for o, _ in times), statistics.median(t for _, t in times)
    row = (
        f"| {label} | {batch} | {', '.join(map(str, sorted(set(prompt_lengths(batch)))))} | {tokens / o:.0f} | "
        f"{tokens / t:.0f} | **{median:.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} |"
    )
    print(f"{label}, batch {batch}: median {median:.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)})")
    return row, median


def random_folder(config: dict, folder: Path):
    """A random fp32 Llama written by transformers' save_pretrained with a tokenizer beside it; its model, which
    makes every new token (no eos), as titanlite's side does."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    tokenizer = write_tokenizer_folder(folder / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return model


def comparisons_of(folder: Path, theirs, compiled: bool) -> list:
    """(label, titanlite's LM, transformers' model, generate options) of each comparison."""
    import transformers

    comparisons = [("eager vs default", titanlite.load(folder, device="cpu"), theirs, {})]
    if compiled:
        lm = titanlite.load(folder, compile=True, device="cpu")
        static = transformers.LlamaForCausalLM.from_pretrained(folder).float().eval()
        static.generation_config.eos_token_id = None
        static.forward = torch.compile(static.forward)
        comparisons += [
            ("compiled vs default", lm, theirs, {}),
            ("compiled vs static + compile", lm, static, {"cache_implementation": "static"}),
        ]
    return comparisons


def batch_rows(comparisons: list, batch: int, new_tokens: int, pairs: int) -> list[str]:
    """Each comparison's row at this batch size, the greedy tokens of both sides checked."""
    generator = torch.Generator().manual_seed(batch)
    prompts = [
        torch.randint(3, CONFIG["vocab_size"], (length,), generator=generator).tolist()
        for length in prompt_lengths(batch)
    ]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.arange(width)[None] >= width - torch.tensor([len(p) for p in prompts])[:, None]
    sampling = Sampling(new_tokens, ignore_eos=True)
    rows = []
    for label, lm, model, options in comparisons:
        results = {}

        def run_titanlite():
            results["titanlite"] = [c.token_ids for c in lm.complete([Prompt("", p) for p in prompts], sampling)]

        def run_transformers():
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask.long(),
                    do_sample=False,
                    pad_token_id=0,
                    max_new_tokens=new_tokens,
                    **options,
                )
            results["transformers"] = out[:, width:].tolist()

        row, _ = compare(label, run_titanlite, run_transformers, batch, new_tokens, pairs)
        same = results["titanlite"] == results["transformers"]
        print(f"  same greedy tokens: {same}")
        rows.append(row + (" yes |" if same else " **no** |"))
    return rows


def seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def copy_bandwidth() -> float:
    """One thread's copy bandwidth: bytes read and written per second, best of 3 copies of 512 MB."""
    source = torch.ones(2**27)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / min(seconds(lambda: target.copy_(source)) for _ in range(3))


def bandwidth_row(folder: Path, new_tokens: int, pairs: int) -> str:
    """The ~100M model's decode tokens/s at batch 1 (compiled) against the copy bandwidth over its weights' bytes
    per token, the two timed back to back in each pair; prints each pair and returns the row."""
    random_folder(HUNDRED_M, folder)
    lm = titanlite.load(folder, compile=True, device="cpu")
    weights = [p for name, p in lm.model.named_parameters() if not name.startswith("tok_embeddings")]
    read = sum(p.numel() * p.element_size() for p in weights)
    matrices = [p for p in weights if p.dim() == 2]
    with torch.no_grad():
        sweep = min(
            seconds(lambda: [torch.nn.functional.linear(torch.ones(1, p.shape[1]), p) for p in matrices])
            for _ in range(3)
        )
    prompt = [
        Prompt(
            "", torch.randint(3, HUNDRED_M["vocab_size"], (32,), generator=torch.Generator().manual_seed(1)).tolist()
        )
    ]
    sampling = Sampling(new_tokens, ignore_eos=True)
    lm.complete(prompt, sampling)  # the warm-up: compiles
    fractions, rates, limits = [], [], []
    for number in range(1, pairs + 1):
        bandwidth = copy_bandwidth()
        lm.speed = type(lm.speed)()
        lm.complete(prompt, sampling)
        rates.append(lm.speed.decode_tokens / lm.speed.decode_seconds)
        limits.append(bandwidth / read)
        fractions.append(rates[-1] / limits[-1])
        print(
            f"  ~100M, batch 1, pair {number}: copy {bandwidth / 1e9:.1f} GB/s, limit {limits[-1]:.1f} tok/s, "
            f"decode {rates[-1]:.1f} tok/s: {fractions[-1]:.2f} of the limit"
        )
    median = statistics.median(fractions)
    params = sum(p.numel() for p in lm.model.parameters())
    print(
        f"~100M ({params / 1e6:.1f}M parameters, {read / 1e6:.0f} MB read per token), batch 1: decode at {median:.2f} "
        f"of the bandwidth limit (pairs {', '.join(f'{f:.2f}' for f in fractions)}); reading the weights once with "
        f"F.linear: {1 / sweep / statistics.median(limits):.2f} of the limit"
    )
    return (
        f"| compiled, batch 1, {params / 1e6:.1f}M parameters ({read / 1e6:.0f} MB per token) | "
        f"{statistics.median(limits):.1f} | {statistics.median(rates):.1f} | **{median:.2f}** | "
        f"{', '.join(f'{f:.2f}' for f in fractions)} | {1 / sweep / statistics.median(limits):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="also compare the compiled paths")
    parser.add_argument("--bandwidth", action="store_true", help="also the ~100M model against the bandwidth limit")
    parser.add_argument("--write", default="", help="markdown file whose generation section this run's rows join")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    root = Path(tempfile.mkdtemp())
    try:
        comparisons = comparisons_of(root / "small", random_folder(CONFIG, root / "small"), args.compiled)
        print(
            f"CPU ({platform.processor() or platform.machine()}), {args.threads} thread(s), torch {torch.__version__}, "
            f"transformers {transformers.__version__}; Llama {CONFIG['num_hidden_layers']} layers dim "
            f"{CONFIG['hidden_size']} vocab {CONFIG['vocab_size']}, {args.new_tokens} new tokens, greedy fp32, "
            f"median of {args.pairs} alternated pairs after a warm-up pair"
        )
        load = f"{os.getloadavg()[0]:.1f}"
        rows = [
            row
            for batch in map(int, args.batches.split(","))
            for row in batch_rows(comparisons, batch, args.new_tokens, args.pairs)
        ]
        del comparisons
        limit = bandwidth_row(root / "100M", args.new_tokens, args.pairs) if args.bandwidth else None
        load += f" to {os.getloadavg()[0]:.1f}"
        print(f"load average (1 minute) {load}: other processes on the machine slow both sides unevenly")
        if args.write:
            write_rows(Path(args.write), rows, limit, args.threads, load)
    finally:
        shutil.rmtree(root)


def write_rows(path: Path, rows: list[str], limit: str | None, threads: int, load: str) -> None:
    """The rows (and the bandwidth row), under a line naming the device, versions, date, the machine's load and the
    command, right after the file's first marker: earlier runs' rows stay below."""
    import transformers

    command = "python " + shlex.join(["scripts/benchmark_generate.py", *sys.argv[1:]])
    block = (
        f"{datetime.date.today()}, CPU ({platform.machine()}, {os.cpu_count()} cores, {threads} thread(s) used, "
        f"load average {load} during the run), torch {torch.__version__}, transformers {transformers.__version__}: "
        f"`{command}`\n\n"
        "| titanlite vs transformers | batch | prompt tokens | titanlite tok/s | transformers tok/s | speed-up "
        "(median) | "
        "pairs | same tokens |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    if limit:
        block += (
            "\n| decode against the bandwidth limit | limit tok/s | decode tok/s | fraction (median) | pairs | "
            "reading the weights once |\n|---|---|---|---|---|---|\n" + limit + "\n"
        )
    text = path.read_text()
    start = text.index(MARKERS[0]) + len(MARKERS[0])
    path.write_text(text[:start] + "\n" + block + "\n" + text[start:].lstrip("\n"))


if __name__ == "__main__":
    main()
