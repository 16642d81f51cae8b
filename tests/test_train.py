"""The trainer run as a user runs it: one process, no launcher."""

import re

import pytest
from conftest import logged_losses, run_titanlite, tensorboard_scalars

from titanlite.train import main

LINE = re.compile(
    r"step: 1  loss: \d+\.\d{4}  grad_norm: \d+\.\d{4}  memory: \d+\.\d\dGiB\(\d+\.\d\d%\)  "
    r"tps: [\d,]+  tflops: \d+\.\d\d  mfu: unknown"
)


def test_trains_prints_the_line_and_writes_config_and_tensorboard(tmp_path, tiny_run):
    out = run_titanlite(tiny_run + ["--metrics.enable_tensorboard", "--training.steps", "6"])
    assert out.returncode == 0, out.stderr
    assert LINE.search(out.stderr), out.stderr
    assert "MFU is not known on cpu" in out.stderr
    assert sorted(logged_losses(out.stderr)) == [1, 2, 3, 4, 5, 6]
    resolved = (tmp_path / "config.toml").read_text()
    assert "steps = 6" in resolved and "seq_len = 64" in resolved
    scalars = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert sorted(scalars) == [1, 2, 3, 4, 5, 6]
    for tag in (
        "optim/grad_norm",
        "optim/lr",
        "throughput/tps",
        "throughput/tflops",
        "memory/reserved_gib",
        "data/wait_share",
    ):
        assert len(tensorboard_scalars(tmp_path / "tb", tag)) == 6


@pytest.mark.extended
def test_same_seed_same_losses_other_seed_other_losses(tmp_path, tiny_run):
    first = logged_losses(run_titanlite(tiny_run).stderr)
    again = logged_losses(run_titanlite(tiny_run).stderr)
    other = run_titanlite(tiny_run + ["--job.seed", "1", "--metrics.peak_tflops", "0.5"])
    assert len(first) == 4 and first == again and first != logged_losses(other.stderr)
    # With a peak given, MFU = tflops / peak is printed as a percentage.
    assert re.search(r"tflops: \d+\.\d\d  mfu: \d+\.\d\d%", other.stderr), other.stderr
    assert not list(tmp_path.rglob("events.out.tfevents*"))  # TensorBoard off (the debug config's default)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.name", "lama3"], "model.name 'lama3' is not a known model family"),
        (["--model.flavor", "8b"], "8B"),
        (["--model.tokenizer_path", "/no/tokenizer.model"], "/no/tokenizer.model"),
        (["--parallelism.data_parallel_shard_degree", "2"], "world size 1"),
        (["--training.seq_len", "16384"], "training.seq_len 16384 exceeds the context"),
        (["--training.global_batch_size", "3"], "training.global_batch_size 3 must be a multiple"),
        (["--training.dataset_path", "/no/data.jsonl"], "/no/data.jsonl"),
        (["--training.steps", "0"], "training.steps must be at least 1"),
    ],
)
def test_user_errors_are_one_sentence_and_exit_2(tiny_run, flags, message, capsys):
    """In this process (main() is what `python -m titanlite.train` exits with): a subprocess each
    would spend ~8 s of the suite on starting Python. test_config runs the real exit path."""
    assert main(tiny_run + flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path, tiny_run, capsys):
    """33,280 ranks + 256 specials do not fit llama2 7B's 32,000-token vocabulary."""
    import base64
    import itertools

    tokens = [bytes([b]) for b in range(256)] + [bytes(p) for p in itertools.product(range(256), range(129))]
    (tmp_path / "big.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    assert (
        main(
            tiny_run
            + ["--model.name", "llama2", "--model.flavor", "7B", "--model.tokenizer_path", str(tmp_path / "big.model")]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        "error: the tokenizer has 33536 tokens but llama2/7B has a vocabulary of 32000; "
        "use that model's own tokenizer (model.tokenizer_path) or a debugmodel flavor"
    )
