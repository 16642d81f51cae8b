"""Run under torchrun by test_tensor_parallel.py: for each family, 5 optimizer steps of the debug
model under TP (the whole world) and of the same model unsharded on every rank (the 1-process
run), through the trainer's own build_model / train_step, on the same batches of several
documents each (the default block-causal mask); argv[2] may list the families (comma-separated). Rank 0 writes
{family: [[tp loss, 1-process loss], ...]} as JSON to argv[1]."""

import json
import sys
import types

import torch
import torch.distributed as dist

from titanlite.build import build_model, forward_settings, resolve_model_args, step_settings
from titanlite.config import load_config
from titanlite.data.tokenizer import build_tokenizer
from titanlite.fault_tolerance import Alone
from titanlite.loss import cross_entropy_loss
from titanlite.models import get_model_spec
from titanlite.objectives.lm import LanguageModelling
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.dims import ParallelDims
from titanlite.run import Run, Training
from titanlite.step import train_step

STEPS, BATCH, SEQ = 5, 2, 64


def losses(name: str, world: int, flags: tuple[str, ...] = ()) -> list[float]:
    cfg = load_config(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--model.name",
            name,
            "--parallelism.tensor_parallel_degree",
            str(world),
            *flags,
        ]
    )
    spec = get_model_spec(cfg.model.name)
    tokenizer = build_tokenizer(cfg.model)
    args = resolve_model_args(cfg, spec, tokenizer.vocab_size)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=world)
    if world > 1:
        dims.build_mesh("cpu")
    model, *_ = build_model(cfg, spec, args, dims, torch.device("cpu"), cross_entropy_loss)
    objective = LanguageModelling()
    run = Run(
        cfg,
        types.SimpleNamespace(device=torch.device("cpu")),
        dims,
        spec,
        args,
        tokenizer,
        model,
        None,
        cross_entropy_loss,
        forward_settings(cfg, dims, torch.device("cpu"), tokenizer),
        step_settings(cfg, 1, objective),
        0,
        0.0,
        objective,
    )
    optimizer = build_optimizer(model, cfg.optimizer, "cpu")
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    metrics = types.SimpleNamespace(data_seconds=0.0, tokens=0, trained=0.0)  # train_step only adds to these
    training = Training(optimizer, scheduler, None, STEPS, metrics, Alone())
    generator = torch.Generator().manual_seed(0)  # the same batches for both runs
    windows = [torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    for w in windows:  # documents starting at bos tokens, so the block-causal mask (the default) splits
        w[:, 10::23] = tokenizer.bos_id
    batches = iter([(w[:, :-1], w[:, 1:]) for w in windows])
    return [train_step(run, training, batches)[0].item() for _ in range(STEPS)]


def write_from_rank0(out_path: str, results) -> None:
    """In a torchrun worker: `results(world)` computed on every rank (gloo, one thread each), written by rank 0
    as JSON to out_path."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    computed = results(dist.get_world_size())
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(computed, f)
    dist.destroy_process_group()


def main(out_path: str, families: str = "llama3,mistral,mixtral,gpt2") -> None:
    write_from_rank0(
        out_path, lambda world: {name: list(zip(losses(name, world), losses(name, 1))) for name in families.split(",")}
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
