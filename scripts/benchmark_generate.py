"""Generation tokens/s of titanlite (python -m titanlite.generate's loop, KV cache) against transformers'
generate on the same random fp32 Llama folder, on the CPU, greedy, the same prompts (two lengths in a batch).

    python scripts/benchmark_generate.py [--batch 4] [--new-tokens 64] [--repeats 3] [--threads 1]

Both produce every one of --new-tokens (no eos stops them), each timed best of --repeats after a warm-up,
and the greedy tokens are checked to be the same.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanlite.config import load_config  # noqa: E402
from titanlite.data.chat_example import write_tokenizer_folder  # noqa: E402
from titanlite.inference.decode import Sampling, generate_ids  # noqa: E402
from titanlite.inference.model import build_inference_model  # noqa: E402
from titanlite.parallel.dist import close_distributed, init_distributed  # noqa: E402

CONFIG = dict(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)


def best_seconds(runs: dict, repeats: int) -> dict[str, float]:
    """Each run's best time of `repeats` after one warm-up, the runs alternating so that a machine that gets
    busier meanwhile slows both."""
    times = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if repeat:
                times[name].append(time.perf_counter() - started)
    return {name: min(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    folder = Path(tempfile.mkdtemp())
    try:
        torch.manual_seed(0)
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float().eval()
        theirs.save_pretrained(folder)
        tokenizer = write_tokenizer_folder(folder / "tokenizer")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, folder / name)
        ours = build_inference_model(load_config(["--job.device", "cpu", "--model.hf_assets_path", str(folder)]),
                                     init_distributed("cpu", 60))
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 2048, (64 if row % 2 else 32,), generator=generator).tolist() for row in range(args.batch)]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        sampling = Sampling(args.new_tokens, stop_ids=())
        results = {}

        def run_titanlite():
            results["titanlite"] = generate_ids(ours.model, ours.args, ours.tokenizer, prompts, sampling)

        def run_transformers():
            with torch.no_grad():
                out = theirs.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, pad_token_id=0,
                                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            results["transformers"] = out[:, width:].tolist()

        seconds = best_seconds({"titanlite": run_titanlite, "transformers": run_transformers}, args.repeats)
        tokens = args.batch * args.new_tokens
        print(f"CPU, {args.threads} threads, torch {torch.__version__}, transformers {transformers.__version__}; Llama "
              f"{CONFIG['num_hidden_layers']} layers dim {CONFIG['hidden_size']}, batch {args.batch} (prompts 32 and 64 "
              f"tokens), {args.new_tokens} new tokens, greedy fp32, best of {args.repeats}")
        for name, value in seconds.items():
            print(f"{name:13s} {tokens / value:8.1f} tokens/s  ({value:.3f} s)")
        print(f"titanlite / transformers: {seconds['transformers'] / seconds['titanlite']:.2f}x; "
              f"same greedy tokens: {results['titanlite'] == results['transformers']}")
    finally:
        close_distributed()
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
