"""Decode tokens/s of a GRPO rollout batch on 2 ranks (docs/benchmarks.md), paired in one launch, rounds times,
alternating. On 2 FSDP ranks: the policy as it trains, sharded, every decoded token all-gathering its weights in
lockstep with the other rank (how rollouts decoded before rl/engine.py), against the colocated engine, which gathers
the weights once per rollout batch and decodes with no collective; each rank decodes its own prompt x
rl.num_generations completions. Under --parallelism.tensor_parallel_degree 2: a whole copy of the weights on each rank
(both decoding the group's completions, each alone) against the colocated engine's copy that keeps each rank's TP
shards (its heads in the KV cache, TP's collectives per layer); the group's completions are counted once.

    torchrun --standalone --nproc_per_node 2 tests/rl_decode_speed.py [rounds] [trainer flags...]
"""

import sys
import time

import torch
import torch.distributed as dist

from titanlite.build import build_run
from titanlite.config import load_config
from titanlite.inference.decode import Sampling, generate_ids
from titanlite.parallel.dist import close_distributed, init_distributed
from titanlite.rl.engine import ColocatedEngine, full_copy

FLAGS = [
    "--job.device",
    "cpu",
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.dataset_format",
    "prompts",
    "--rl.reward_functions",
    "tests/grpo_rewards.py:letter_share",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "8",
    "--training.global_batch_size",
    "16",
    "--rl.num_generations",
    "8",
    "--rl.max_new_tokens",
    "128",
    "--training.mixed_precision_param",
    "float32",
]


def decode_rate(generate, prompts, counts: bool) -> tuple[float, int]:
    """(decode tokens/s of one rollout batch over the ranks that `counts`, its decoded tokens), the slower rank's
    time."""
    dist.barrier()
    began = time.perf_counter()
    tokens = generate(prompts)
    seconds = torch.tensor([time.perf_counter() - began])
    counted = torch.tensor([tokens if counts else 0])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(counted)
    return counted.item() / seconds.item(), int(counted.item())


def main(rounds: int, extra: list[str]) -> None:
    cfg = load_config(FLAGS + extra)
    info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
    run = build_run(cfg, info)
    rl, rank = cfg.rl, run.dims.dp_rank  # a TP group decodes one prompt's completions
    prompt = run.tokenizer.encode(f"Question {rank}: say eeee", bos=True, eos=False)  # one prompt per rank
    prompts = [prompt] * rl.num_generations
    indices = [rank * len(prompts) + i for i in range(len(prompts))]
    # no stop token: every completion is max_new_tokens long, the same work on both paths and ranks
    sampling = Sampling(rl.max_new_tokens, rl.temperature, seed=cfg.job.seed, stop_ids=())
    engine = ColocatedEngine(run)

    def per_token(batch):
        run.model.eval()
        generated = generate_ids(run.model, run.args, run.tokenizer, batch, sampling, lockstep=True, indices=indices)
        return sum(len(g.token_ids) for g in generated)

    def gathered_once(batch):
        return sum(len(c.ids) for c in engine.generate(batch, sampling, indices))

    def whole_copy(batch):
        return sum(len(c.ids) for c in engine.decode(full_copy(run), batch, sampling, indices, 0))

    tp = run.dims.tp_enabled
    paths = (
        {"whole copy": whole_copy, "head-sharded": gathered_once}
        if tp
        else {"per token": per_token, "once": gathered_once}
    )
    counts = not tp or run.dims.tp_mesh.get_local_rank() == 0
    rates = {name: [] for name in paths}
    for _ in range(rounds):
        for name, generate in paths.items():
            rates[name].append(decode_rate(generate, prompts, counts))
    if info.rank == 0:
        for name, values in rates.items():
            print(f"{name}: " + ", ".join(f"{rate:.1f} tokens/s ({tokens} tokens)" for rate, tokens in values))
        (before, after), best = paths, {name: max(rate for rate, _ in values) for name, values in rates.items()}
        print(
            f"best of {rounds}: {before} {best[before]:.1f}, {after} {best[after]:.1f} tokens/s, "
            f"{best[after] / best[before]:.2f}x"
        )
    close_distributed()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, sys.argv[2:])
