"""Issue 53: a resume restores the CPU RNG exactly. Each resume used to leave it two draws short (the data loader's
iter() drew its workers' base seed from it after the restore), so a model that draws random numbers (here LoRA's
dropout) trained on other numbers after every resume.
"""

import gc
from pathlib import Path

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU, logged_losses

from titanlite.checkpoint.fit import load_in_place
from titanlite.train import main as train_main


def train(capsys, folder: Path, steps: int, *data: str) -> str:
    capsys.readouterr()
    code = train_main(
        [
            *ON_CPU,
            "--job.config_file",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--lr_scheduler.min_lr_factor",
            "1",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--lora.rank",
            "4",
            "--lora.dropout",
            "0.5",
            *data,
        ]
    )
    gc.enable()  # the trainer leaves it off
    out = capsys.readouterr().err
    assert code == 0, out
    return out


def saved_cpu_rng(folder: Path, step: int) -> torch.Tensor:
    target = {"rng": {"rank_0": {"cpu": torch.zeros_like(torch.get_rng_state())}}}
    return load_in_place(folder / "checkpoint" / f"step-{step}", target)["rng"]["rank_0"]["cpu"]


def token_store(folder: Path) -> str:
    import json

    from titanlite.data.prepare import prepare
    from titanlite.data.sample_corpus import sample_split

    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_split("train")[:40]))
    prepare(str(folder / "texts.jsonl"), str(folder / "store"))
    return str(folder / "store")


@pytest.mark.parametrize(
    "data", ["sample", "store"]
)  # the two loaders: a raw dataset's per rank, a store's global order
def test_resumes_restore_the_cpu_rng_exactly_and_dropout_trains_the_same(capsys, tmp_path, data):
    flags = ["--training.dataset_path", token_store(tmp_path)] if data == "store" else []
    reference = logged_losses(train(capsys, tmp_path / "reference", 6, *flags))
    resumed = {}
    for steps in (2, 4, 6):  # two resumes
        resumed |= logged_losses(train(capsys, tmp_path / "resumed", steps, *flags))
    assert resumed == reference and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 6):  # the state each resume's run saved is the uninterrupted run's at that step
        assert torch.equal(saved_cpu_rng(tmp_path / "resumed", step), saved_cpu_rng(tmp_path / "reference", step)), step
    # and the draws differ from step to step (dropout draws them): the equality above is not of untouched states
    assert not torch.equal(saved_cpu_rng(tmp_path / "reference", 4), saved_cpu_rng(tmp_path / "reference", 6))
