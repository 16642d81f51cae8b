"""Validation: the held-out sample split, the validator's numbers, and validation in real runs
(console, TensorBoard, the training data position untouched, two ranks agreeing)."""

import json
import math
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import DEBUG_CONFIG, logged_losses, run_titanlite, tensorboard_scalars

from titanlite.config_sections import Parallelism, Training, Validation
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.sample_corpus import HELD_OUT, sample_documents, sample_split
from titanlite.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer
from titanlite.errors import UserError
from titanlite.loss import cross_entropy_loss
from titanlite.metrics.validation import Validator, check_validation
from titanlite.models import get_model_args, get_model_spec
from titanlite.parallel.dims import ParallelDims
from titanlite.run import ForwardSettings

VALIDATE_LINE = re.compile(
    r"validate step: (\d+)  loss: (\d+\.\d{4})  perplexity: (\d+\.\d{4})  batches: (\d+)  tokens: ([\d,]+)"
)


def validation_lines(output: str) -> dict[int, tuple[float, float, int]]:
    return {
        int(s): (float(loss), float(ppl), int(batches)) for s, loss, ppl, batches, _ in VALIDATE_LINE.findall(output)
    }


def test_sample_val_is_held_out_from_sample():
    train, held_out = sample_split("train"), sample_split("validation")
    assert len(held_out) == HELD_OUT and len(train) > 5 * HELD_OUT
    assert train + held_out == sample_documents()
    assert not set(train) & set(held_out)


# --- the validator in this process, on a world of one ------------------------------------------


class Recorder:
    """Stands in for MetricsLogger: keeps what the validator reports."""

    def __init__(self):
        self.calls = []

    def log_validation(self, step, loss, perplexity, batches, tokens, seconds):
        self.calls.append((step, loss, perplexity, batches, tokens))


def validated(validation: Validation, training: Training, tokenizer, dims):
    """What Validator reads of build.py's Run, for a model a test built itself on one rank."""
    from types import SimpleNamespace

    from titanlite.config_sections import JobConfig

    cfg = JobConfig()
    cfg.validation, cfg.training = validation, training
    return SimpleNamespace(
        cfg=cfg,
        loss_fn=cross_entropy_loss,
        forward=ForwardSettings(training.mixed_precision_param, False),
        pipeline=None,
        dims=dims,
        device=torch.device("cpu"),
        tokenizer=tokenizer,
    )


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims.from_config(Parallelism(), 1)
    dims.build_mesh("cpu")
    yield dims
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(SHIPPED_TOKENIZER)


def tiny_model(vocab_size: int, family: str = "llama3"):
    spec = get_model_spec(family)
    args = replace(
        get_model_args(spec, "debugmodel"), vocab_size=vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2
    )
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.train()


def held_out_batches(tokenizer, count: int | None = None) -> list:
    loader = build_dataloader(DataSpec("sample_val", "", 32, 2, infinite=False), tokenizer, 0, 1, 0)
    return list(loader)[:count]


def test_validator_reads_the_same_batches_every_time_and_weighs_tokens(one_rank, tokenizer):
    model = tiny_model(tokenizer.vocab_size)
    training = Training(local_batch_size=2, seq_len=32, mixed_precision_param="float32")
    recorder = Recorder()
    validator = Validator(validated(Validation(enable=True, steps=3), training, tokenizer, one_rank), recorder)

    first = validator.validate(model, step=5)
    assert model.training  # back in train mode
    second = validator.validate(model, step=10)
    assert first == second  # each pass starts from the beginning, not where the last one stopped

    with torch.no_grad():
        batches = held_out_batches(tokenizer, 3)
        total = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in batches)
    expected = total.item() / (3 * 2 * 32)
    assert first[0] == pytest.approx(expected, rel=1e-6)
    assert first[1] == pytest.approx(math.exp(expected), rel=1e-6)
    assert recorder.calls[0] == (5, first[0], first[1], 3, 3 * 2 * 32)

    whole = Validator(validated(Validation(enable=True, steps=-1), training, tokenizer, one_rank), recorder)
    whole.validate(model, step=1)
    assert recorder.calls[-1][3] == len(held_out_batches(tokenizer))  # steps -1: the whole held-out split


def test_validation_forwards_stay_out_of_the_moe_router_statistics(one_rank, tokenizer):
    model = tiny_model(tokenizer.vocab_size, "mixtral")
    validator = Validator(
        validated(Validation(enable=True, steps=2), Training(local_batch_size=2, seq_len=32), tokenizer, one_rank),
        Recorder(),
    )
    validator.validate(model, step=1)
    assert model.extra_metrics() == {}  # what the next training log reports counts training forwards only


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"seq_len": 4096}, "validation.seq_len 4096 exceeds the model's context (2048)"),
    ],
)
def test_bad_validation_settings_are_user_errors(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_validation(Validation(enable=True, **overrides), Training(), max_seq_len=2048)


def test_synthetic_cannot_be_validated_on(one_rank, tokenizer):
    with pytest.raises(UserError, match="validation.dataset synthetic is an endless stream"):
        Validator(validated(Validation(enable=True, dataset="synthetic"), Training(), tokenizer, one_rank), Recorder())


# --- real runs ---------------------------------------------------------------------------------


def test_validation_in_a_run_leaves_training_untouched(tmp_path, tiny_run):
    """Console line and TensorBoard agree; the training losses are those of a run without validation."""
    validated = run_titanlite(
        tiny_run
        + [
            "--validation.enable",
            "--validation.freq",
            "2",
            "--validation.steps",
            "3",
            "--metrics.enable_tensorboard",
        ]
    )
    assert validated.returncode == 0, validated.stderr
    plain = run_titanlite(tiny_run + ["--job.dump_folder", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr

    losses = logged_losses(validated.stderr)
    assert sorted(losses) == [1, 2, 3, 4] and losses == logged_losses(plain.stderr)
    lines = validation_lines(validated.stderr)
    assert sorted(lines) == [2, 4], validated.stderr
    assert "validation every 2 steps on sample_val: up to 3 batches of 2 x 64 tokens per rank" in validated.stderr
    tb_loss = tensorboard_scalars(tmp_path / "tb", "loss/validation")
    tb_perplexity = tensorboard_scalars(tmp_path / "tb", "perplexity/validation")
    for step, (loss, perplexity, batches) in lines.items():
        assert batches == 3
        assert 0 < loss < 10 and perplexity == pytest.approx(math.exp(loss), rel=1e-3)
        assert tb_loss[step] == pytest.approx(loss, abs=1e-4)
        assert tb_perplexity[step] == pytest.approx(perplexity, abs=1e-3)
    assert lines[4][0] != lines[2][0]  # the model trained in between


def test_two_ranks_agree_and_stop_together_with_rank_logs(tmp_path, tokenizer):
    """Ranks hold different shares of the held-out file; all stop when the smaller share runs out,
    and every rank computes the same loss. Rank 1 prints only its warnings, prefixed, and logs
    everything to its own file."""
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"doc {i}: " + "held out words " * (15 * (i + 1))}) + "\n" for i in range(6))
    )
    shares = [
        len(list(build_dataloader(DataSpec("local", str(data), 64, 2, infinite=False), tokenizer, rank, 2, 0)))
        for rank in range(2)
    ]
    assert shares[0] != shares[1] and min(shares) > 0, shares
    dump = tmp_path / "run"
    out = run_titanlite(
        [
            "--job.config_file",
            DEBUG_CONFIG,
            "--job.dump_folder",
            str(dump),
            "--job.log_rank_files",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--training.dataset_path",
            str(data),
            "--validation.enable",
            "--validation.freq",
            "2",
            "--validation.steps",
            "-1",
            "--validation.dataset_path",
            str(data),
        ],
        nproc=2,
    )
    assert out.returncode == 0, out.stderr
    ((loss, _, batches),) = validation_lines(out.stderr).values()
    assert batches == min(shares)

    rank0, rank1 = ((dump / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
    assert validation_lines(rank0) == validation_lines(rank1) == validation_lines(out.stderr)
    # The same warning on both ranks (validation reads the training data): rank 1's is prefixed.
    warning = "WARNING validation reads the training data"
    console = out.stderr.splitlines()
    assert any(re.match(rf"\d\d:\d\d:\d\d {warning}", line) for line in console), out.stderr
    assert any(re.match(rf"\[rank1\] \d\d:\d\d:\d\d {warning}", line) for line in console), out.stderr
    assert not any(line.startswith("[rank1]") and " INFO " in line for line in console), out.stderr
    assert all(line.startswith("[rank1] ") for line in rank1.splitlines())
    assert " INFO step: 2 " in rank1 and " INFO model llama3/debugmodel" in rank1
    assert " INFO model llama3/debugmodel" in rank0 and "[rank" not in rank0
