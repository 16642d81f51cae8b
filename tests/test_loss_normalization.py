"""Chat data: the loss is the sum of the trained tokens' losses over the whole global batch divided by
their count, so the logged loss and the gradients do not depend on how the batch is cut into
micro-batches, accumulation steps and data-parallel ranks (the mean of per-micro-batch means would
weigh a short answer like a long one). Text trains on every token: its losses are unchanged."""

import pytest

from conftest import DEBUG_CONFIG, ON_CPU, run_titanlite, tensorboard_scalars
from titanlite.data import chat_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    chat_example.main(["--output", str(folder), "--conversations", "60"])
    return folder


def chat_flags(example, dump, local_batch, *extra, data_parallel=1) -> list[str]:
    return [*ON_CPU, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(dump), "--model.hf_assets_path",
            str(example / "tokenizer"), "--training.dataset_path", str(example / "chats.jsonl"),
            "--training.dataset_format", "chat", "--training.seq_len", "128", "--training.local_batch_size",
            str(local_batch), "--training.steps", "4", "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "--validation.enable", "--validation.freq", "2",
            "--validation.steps", "-1", "--validation.dataset_path", str(example / "chats.jsonl"),
            "--validation.local_batch_size", str(4 // data_parallel), *map(str, extra)]


def losses(dump) -> dict[int, float]:
    """Training losses by step, and validation's as step + 0.5."""
    validation = tensorboard_scalars(dump / "tb", "loss/validation")
    return {**tensorboard_scalars(dump / "tb", "loss/train"), **{step + 0.5: loss for step, loss in validation.items()}}


@pytest.fixture(scope="module")
def one_process(example, tmp_path_factory):
    """One process holding the whole global batch of 4 windows."""
    dump = tmp_path_factory.mktemp("one")
    run = run_titanlite(chat_flags(example, dump, 4))
    assert run.returncode == 0, "\n".join(run.stderr.splitlines()[-150:])  # enough lines to hold a dying rank's cause
    return losses(dump)


@pytest.mark.parametrize("layout, nproc, flags", [
    ("accumulation", 1, ["--training.global_batch_size", "4"]),
    ("fsdp2", 2, []),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2"]),
    ("cp2", 2, ["--parallelism.context_parallel_degree", "2"]),  # each rank trains on some of each window's answers
])
def test_every_layout_gives_the_loss_of_one_process(example, one_process, tmp_path, layout, nproc, flags):
    """Chat data is read in one global order, so every layout holds the same 4 windows each step; step 2 on
    also shows the earlier updates were the same; validation (after steps 2 and 4) sums the trained tokens'
    losses of the same held-out windows over the same count."""
    local_batch = {"accumulation": 1, "fsdp2": 2}.get(layout, 4)
    run = run_titanlite(chat_flags(example, tmp_path, local_batch, *flags, data_parallel=2 if layout == "fsdp2" else 1), nproc=nproc)
    assert run.returncode == 0, "\n".join(run.stderr.splitlines()[-150:])  # enough lines to hold a dying rank's cause
    if layout == "accumulation":
        assert "(4 micro-steps)" in run.stderr
    theirs = losses(tmp_path)
    assert sorted(theirs) == sorted(one_process) == [1, 2, 2.5, 3, 4, 4.5]
    assert all(theirs[s] == pytest.approx(one_process[s], rel=1e-6) for s in one_process), (one_process, theirs)
