"""torchrun --nproc_per_node 2 tests/eval_fsdp_run.py OUT FOLDER TASKS: the in-loop evaluator on the model of the
Hugging Face folder FOLDER sharded by FSDP over both ranks (the trainer's build_model, the folder's weights loaded
into the shards), the local task tiny_mc of the task folder TASKS, and greedy generation on the sharded model.
Rank 0 writes {"scalars": {task/metric: value}, "generated": [[token ids]]} to OUT as JSON."""

from types import SimpleNamespace
import sys

import torch
from tp_families import write_from_rank0

from titanlite.build import build_model, model_label, resolve_model_args
from titanlite.checkpoint.hf_io import load_model_from_hf
from titanlite.config import load_config
from titanlite.data.tokenizer import build_tokenizer
from titanlite.eval_loop import InLoopEvaluator
from titanlite.generation import Sampling, generate_ids
from titanlite.loss import build_loss
from titanlite.metrics import MetricsLogger
from titanlite.models import get_model_spec
from titanlite.parallel.dims import ParallelDims

PROMPTS = [[5, 17, 300, 42, 8, 99, 120], [400, 12, 77]]


def evaluate(folder: str, tasks: str, world: int) -> dict:
    cfg = load_config(["--job.device", "cpu", "--model.hf_assets_path", folder, "--training.seq_len", "64",
                       "--training.mixed_precision_param", "float32", "--eval.tasks", "tiny_mc", "--eval.include_path", tasks,
                       "--eval.interval", "1", "--eval.batch_size", "4"])
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    tokenizer = build_tokenizer(cfg.model)
    spec = get_model_spec(cfg.model.name)
    args = resolve_model_args(cfg, spec, tokenizer.vocab_size)
    model, *_ = build_model(cfg, spec, args, dims, torch.device("cpu"), build_loss(cfg.training, cfg.compile))
    load_model_from_hf(model.state_dict(), cfg.checkpoint.initial_load_path, spec.hf_adapter, args, model_label(cfg.model))
    metrics = MetricsLogger(cfg.metrics, torch.distributed.get_rank(), torch.device("cpu"), 0.0)
    cfg.training.steps = 1
    scalars = InLoopEvaluator(SimpleNamespace(cfg=cfg, tokenizer=tokenizer, args=args), metrics).evaluate(model, 1)
    model.eval()
    generated = generate_ids(model, args, tokenizer, PROMPTS, Sampling(8, stop_ids=()))
    return {"scalars": scalars, "generated": generated}


if __name__ == "__main__":
    out, folder, tasks = sys.argv[1:]
    write_from_rank0(out, lambda world: evaluate(folder, tasks, world))
