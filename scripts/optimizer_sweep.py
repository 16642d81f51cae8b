"""Muon against AdamW on the llama3 debug model (2 of its blocks), each at the best of a few peak learning
rates: the same initial weights, the same batches of the shipped sample corpus, the same schedule (warmup,
linear decay), one CPU process in fp32. Every EVAL_EVERY steps each run's loss on the same held-out
batches (the corpus's sample_val topics) is taken: a single training batch's loss varies by a nat from
batch to batch. Prints each run's held-out losses and the best runs' curves, which docs/optimizers.md quotes:

    PYTHONPATH=$PWD python scripts/optimizer_sweep.py
"""

from dataclasses import replace

import torch
import torch.nn.functional as F

from titanlite.config_sections import LRScheduler, Model, Optimizer
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models import get_model_args, get_model_spec
from titanlite.optim import build_lr_scheduler, build_optimizer

STEPS, BATCH, SEQ, EVAL_EVERY, EVAL_BATCHES = 40, 4, 128, 5, 4
# (optimizer, lr, muon_lr): Muon's AdamW half (embedding, norms, output) keeps AdamW's best lr; its matrices' lr is
# swept.
RUNS = [
    ("AdamW", 3e-4, -1.0),
    ("AdamW", 1e-3, -1.0),
    ("AdamW", 3e-3, -1.0),
    ("AdamW", 1e-2, -1.0),
    ("Muon", 1e-3, 3e-3),
    ("Muon", 1e-3, 1e-2),
    ("Muon", 1e-3, 3e-2),
    ("Muon", 1e-3, 1e-1),
]
SCHEDULE = LRScheduler(warmup_steps=4, decay_type="linear", min_lr_factor=0.1)


def batches(tokenizer, dataset: str, count: int) -> list:
    loader = build_dataloader(DataSpec(dataset, "", SEQ, BATCH), tokenizer, 0, 1, 0)
    it = iter(loader)
    return [next(it) for _ in range(count)]


@torch.no_grad()
def held_out_loss(model, held_out: list) -> float:
    return sum(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item() for x, y, *_ in held_out) / len(
        held_out
    )


def train(name: str, lr: float, muon_lr: float, data: list, held_out: list, vocab: int) -> list[float]:
    """The held-out loss at step 0 and every EVAL_EVERY steps."""
    spec = get_model_spec("llama3")
    args = replace(get_model_args(spec, "debugmodel"), n_layers=2, vocab_size=vocab)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, Optimizer(name=name, lr=lr, muon_lr=muon_lr), "cpu")
    scheduler = build_lr_scheduler(optimizer, SCHEDULE, STEPS)
    losses = [held_out_loss(model, held_out)]
    for step, (inputs, labels, *_) in enumerate(data, start=1):
        F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % EVAL_EVERY == 0:
            losses.append(held_out_loss(model, held_out))
    return losses


def main() -> None:
    torch.manual_seed(0)
    tokenizer = build_tokenizer(Model())
    data, held_out = batches(tokenizer, "sample", STEPS), batches(tokenizer, "sample_val", EVAL_BATCHES)
    best = {}
    for name, lr, muon_lr in RUNS:
        losses = train(name, lr, muon_lr, data, held_out, tokenizer.vocab_size)
        label = f"{name} lr {lr:g}" + (f" muon_lr {muon_lr:g}" if muon_lr >= 0 else "")
        print(f"{label}: held-out loss " + " ".join(f"{x:.3f}" for x in losses), flush=True)
        if name not in best or losses[-1] < best[name][1][-1]:
            best[name] = (label, losses)
    print("step | " + " | ".join(label for label, _ in best.values()))
    for index in range(STEPS // EVAL_EVERY + 1):
        print(f"{index * EVAL_EVERY} | " + " | ".join(f"{losses[index]:.3f}" for _, losses in best.values()))


if __name__ == "__main__":
    main()
