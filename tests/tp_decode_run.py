"""Run by test_rl_engine.py on 2 torchrun ranks (conftest's torchrun_json): for each family's debug model under
tensor parallelism 2, a GRPO rollout decoded as the colocated engine decodes it (rl/engine.py's tp_copy: each rank's
TP shards, its heads' keys and values in the KV cache) against a whole copy's decode (full_copy, no collective), and
a stop flag raised on one rank only. Rank 0 writes, per family, what the test asserts:

    {"same_ids": the same completions, "logprob_gap": the largest log-probability difference,
     "cache_size": [the sharded decode's, the whole copy's] elements in a block's KV cache,
     "engine_same": ColocatedEngine.generate's completions are the sharded decode's,
     "stopped": [whether each rank's decode ended with RolloutStopped]}

    torchrun --standalone --nproc_per_node 2 tests/tp_decode_run.py <out.json>
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from titanlite.build import build_run
from titanlite.config import load_config
from titanlite.inference.decode import Sampling, generate_ids, token_step
from titanlite.parallel.dist import close_distributed, init_distributed
from titanlite.rl.engine import ColocatedEngine, RolloutStopped, full_copy, tp_copy

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "mixtral", "gpt2", "deepseek_v3")


def flags(model: str, folder: Path) -> list[str]:
    return [
        *("--job.device", "cpu", "--job.config_file", "train_configs/debug_model.toml"),
        *("--job.dump_folder", str(folder / model), "--model.name", model),
        *("--training.dataset_format", "prompts", "--training.dataset_path", str(folder / "prompts.jsonl")),
        *("--rl.reward_functions", "tests/grpo_rewards.py:letter_share", "--training.seq_len", "64"),
        *("--training.local_batch_size", "4", "--training.global_batch_size", "4", "--rl.num_generations", "4"),
        *("--training.mixed_precision_param", "float32", "--parallelism.tensor_parallel_degree", "2"),
    ]


def decode(model, run, prompts, sampling) -> tuple[list, int]:
    """(the Generated of each prompt, the elements of block 0's KV cache on this rank)."""
    sizes = []

    def step(model, cache, tokens):
        sizes.append(sum(t.numel() for t in cache.layers["0"]))
        token_step(model, cache, tokens)

    return generate_ids(model, run.args, run.tokenizer, prompts, sampling, indices=[0, 1, 2, 3], step=step), sizes[0]


def check(model_name: str, folder: Path, rank: int, info) -> dict:
    run = build_run(load_config(flags(model_name, folder)), info)
    prompt = run.tokenizer.encode("Question 1: say eeee", bos=True, eos=False)
    prompts = [prompt, prompt[:4], prompt, prompt[:7]]
    sampling = Sampling(20, 1.0, seed=5, stop_ids=())  # no stop token: 20 tokens each, every step compared
    sharded, sharded_size = decode(tp_copy(run), run, prompts, sampling)
    whole, whole_size = decode(full_copy(run), run, prompts, sampling)
    engine = ColocatedEngine(run)
    by_engine = engine.generate(prompts, sampling, [0, 1, 2, 3])
    engine.stopping = lambda: rank == 0  # a signal that reached rank 0 only
    try:
        engine.generate(prompts, sampling, [0, 1, 2, 3])
        stopped = False
    except RolloutStopped:
        stopped = True
    stops = [None, None]
    dist.all_gather_object(stops, stopped)
    return {
        "same_ids": [g.token_ids for g in sharded] == [g.token_ids for g in whole],
        "logprob_gap": max(abs(a - b) for s, w in zip(sharded, whole) for a, b in zip(s.logprobs, w.logprobs)),
        "cache_size": [sharded_size, whole_size],
        "engine_same": [c.ids for c in by_engine] == [g.token_ids for g in sharded],
        "stopped": stops,
    }


def main(out_file: str) -> None:
    folder = Path(out_file).parent
    (folder / "prompts.jsonl").write_text(json.dumps({"prompt": "Question 1: say eeee", "answer": "1"}) + "\n")
    info = init_distributed("cpu", 300)
    results = {name: check(name, folder, info.rank, info) for name in FAMILIES}
    if info.rank == 0:
        Path(out_file).write_text(json.dumps(results))
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
