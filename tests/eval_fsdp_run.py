"""torchrun --nproc_per_node 2 tests/eval_fsdp_run.py OUT FOLDER TASKS: the generate/eval model (inference/model.py) of
the
Hugging Face folder FOLDER, sharded by FSDP over both ranks; the in-loop evaluator on it with the local tasks of the
task folder TASKS, the ranks sharing the requests; then each rank generating greedily for its own prompt with its
own max_new_tokens, in lockstep. Rank 0 writes {"scalars": {task/metric: value}, "generated": [[ids] per rank]}."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from titanlite.config import load_config
from titanlite.evaluation.in_loop import InLoopEvaluator
from titanlite.inference.decode import Sampling, generate_ids
from titanlite.inference.model import build_inference_model
from titanlite.metrics import MetricsLogger
from titanlite.parallel.dist import close_distributed, init_distributed

TASK_NAMES = "tiny_mc,tiny_gen,tiny_rolling"
PROMPTS = [[5, 17, 300, 42, 8, 99, 120], [400, 12, 77]]  # rank r generates PROMPTS[r], NEW_TOKENS[r] tokens
NEW_TOKENS = [8, 3]


def inference_config(folder: str, *flags: str):
    """fp32 throughout: FSDP computes in training.mixed_precision_param (bfloat16 by default), one process in fp32."""
    return load_config(
        [
            "--job.device",
            "cpu",
            "--model.hf_assets_path",
            folder,
            "--eval.batch_size",
            "4",
            "--training.mixed_precision_param",
            "float32",
            *flags,
        ]
    )


def main(out: str, folder: str, tasks: str) -> None:
    torch.set_num_threads(1)
    cfg = inference_config(
        folder,
        "--eval.tasks",
        TASK_NAMES,
        "--eval.include_path",
        tasks,
        "--eval.at_end",
        "true",
        "--training.steps",
        "1",
    )
    info = init_distributed("cpu", 60)
    run = build_inference_model(cfg, info)
    metrics = MetricsLogger(cfg.metrics, info.rank, info.device, 0.0)
    scalars = InLoopEvaluator(run, SimpleNamespace(metrics=metrics, steps=1)).evaluate(1)  # what it reads of a Training
    new = generate_ids(
        run.model,
        run.args,
        run.tokenizer,
        [PROMPTS[info.rank]],
        Sampling(NEW_TOKENS[info.rank], stop_ids=()),
        lockstep=True,
    )[0].token_ids
    generated = [None] * info.world_size
    dist.all_gather_object(generated, new)
    if info.rank == 0:
        with open(out, "w") as file:
            json.dump({"scalars": scalars, "generated": generated}, file)
    close_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
