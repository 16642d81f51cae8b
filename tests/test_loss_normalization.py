"""Chat data: the loss is the sum of the trained tokens' losses over the whole global batch divided by
their count, so the logged loss and the gradients do not depend on how the batch is cut into
micro-batches, accumulation steps and data-parallel ranks (the mean of per-micro-batch means would
weigh a short answer like a long one). Text trains on every token: its losses are unchanged."""

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, tensorboard_scalars
from test_chat_data import loader
from test_pipeline_parallel import launch

from titanlite.examples import chat_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    chat_example.main(["--output", str(folder), "--conversations", "60"])
    return folder


def chat_flags(example, dump, local_batch, *extra, data_parallel=1) -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--model.hf_assets_path",
        str(example / "tokenizer"),
        "--training.dataset_path",
        str(example / "chats.jsonl"),
        "--training.dataset_format",
        "chat",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        str(local_batch),
        "--training.steps",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--validation.enable",
        "--validation.freq",
        "2",
        "--validation.steps",
        "-1",
        "--validation.dataset_path",
        str(example / "chats.jsonl"),
        "--validation.local_batch_size",
        str(4 // data_parallel),
        *map(str, extra),
    ]


def losses(dump) -> dict[int, float]:
    """Training losses by step, and validation's as step + 0.5."""
    validation = tensorboard_scalars(dump / "tb", "loss/validation")
    return {**tensorboard_scalars(dump / "tb", "loss/train"), **{step + 0.5: loss for step, loss in validation.items()}}


LAYOUTS = {  # name: (processes, local batch, flags); the global batch is 4 windows in each
    "accumulation": (1, 1, ["--training.global_batch_size", "4"]),
    "fsdp2": (2, 2, []),
    "tp2": (2, 4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, 4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, 4, ["--parallelism.context_parallel_degree", "2"]),  # each rank trains on some of each window's answers
}


@pytest.mark.extended
def test_every_layout_gives_the_loss_of_one_process(example, tmp_path):
    """Chat data is read in one global order, so every layout holds the same 4 windows each step as one process
    holding all 4 (conversations packed several to a window, each with its carried document ids); step 2 on also shows
    the earlier updates were the same; validation (after steps 2 and 4) sums
    the trained tokens' losses of the same held-out windows over the same count. One launch per world size
    (tests/layout_runs.py)."""

    def layout_run(name: str, local_batch: int, flags: list[str]) -> dict:
        return {
            "argv": chat_flags(example, tmp_path / name, local_batch, *flags, data_parallel=2 if name == "fsdp2" else 1)
        }

    one = launch(
        [
            layout_run("one", 4, []),
            *(layout_run(name, batch, flags) for name, (world, batch, flags) in LAYOUTS.items() if world == 1),
        ],
        1,
        tmp_path,
        "world1",
    )
    assert "(4 micro-steps)" in one
    launch(
        [layout_run(name, batch, flags) for name, (world, batch, flags) in LAYOUTS.items() if world == 2],
        2,
        tmp_path,
        "world2",
    )
    one_process = losses(tmp_path / "one")
    # the 16 windows trained hold packed conversations (a window's document ids: its conversations, then the padding)
    windows = next(iter(loader(example / "tokenizer", example / "chats.jsonl", 256, batch_size=16)))
    assert (windows[2]["document_ids"].amax(dim=1) >= 2).sum() >= 4
    assert sorted(one_process) == [1, 2, 2.5, 3, 4, 4.5]
    for name in LAYOUTS:
        theirs = losses(tmp_path / name)
        assert sorted(theirs) == sorted(one_process), (name, theirs)
        assert all(theirs[s] == pytest.approx(one_process[s], rel=1e-6) for s in one_process), (
            name,
            one_process,
            theirs,
        )
