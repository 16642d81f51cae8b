"""torchrun --nproc_per_node 2 tests/tp_activation_run.py OUT [flags]: the most bytes a real TP2 forward + backward
holds
on rank 0, for each activation checkpoint mode, counted by the planner's own LiveBytes on the local shards (its split 1:
the bytes are the rank's). Rank 0 writes {mode: peak} to OUT as JSON."""

import json
import sys

import torch
import torch.distributed as dist

from titanlite.config import load_config
from titanlite.loss import build_loss, loss_parallel_context, micro_batch_loss
from titanlite.models import get_model_spec
from titanlite.models.construct import meta_model, parallelizer
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.parallelize import ParallelizeSettings
from titanlite.plan.activations import LiveBytes
from titanlite.plan.job import model_args

AC_MODES = ("none", "selective", "full")


def peak_of_a_step(cfg) -> int:
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    model = parallelizer(spec, dims, ParallelizeSettings.of(cfg))(
        meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    )
    model.to_empty(device="cpu")
    model.init_weights(0)
    loss_fn = build_loss(cfg.training, cfg.compile)
    tokens = torch.randint(
        0,
        args.vocab_size,
        (cfg.training.local_batch_size, cfg.training.seq_len),
        generator=torch.Generator().manual_seed(0),
    )

    def step():
        with loss_parallel_context(not cfg.parallelism.disable_loss_parallel):
            context = mixed_precision_context(dims, cfg.training.mixed_precision_param, "cpu")
            micro_batch_loss(model, tokens, tokens, {}, loss_fn, context)[0].backward()

    step()  # the first step makes what later steps reuse
    model.zero_grad(set_to_none=True)
    tally = LiveBytes(1, [*model.parameters(), *model.buffers(), tokens])
    with tally:
        step()
    return tally.peak


def main(out: str, flags: list[str]) -> None:
    dist.init_process_group("gloo")
    peaks = {}
    for mode in AC_MODES:
        cfg = load_config(
            [*flags, "--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", "op"]
        )
        peaks[mode] = peak_of_a_step(cfg)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(peaks, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
