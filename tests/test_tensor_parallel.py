"""Tensor + sequence parallelism on CPU (gloo): the losses of a 1-process run, and every refused layout."""

import dataclasses
import re
import shutil

import pytest
from conftest import assert_planned_state, logged_losses, run_titanlite, torchrun_json

from titanlite.config_sections import Parallelism
from titanlite.errors import UserError
from titanlite.models import get_model_args, get_model_spec
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.tp import check_tensor_parallel


@pytest.mark.extended
def test_tp2_every_family_equals_one_process(tmp_path):
    """llama3, mistral (sliding window cut in: seq 64 > window 32), mixtral (expert-parallel) and
    gpt2 (fused q/k/v by heads): 5 steps under TP2 give the unsharded model's losses."""
    results = torchrun_json("tp_families.py", tmp_path)
    assert sorted(results) == ["gpt2", "llama3", "mistral", "mixtral"]
    for name, pairs in results.items():
        assert len(pairs) == 5
        for tp_loss, one_loss in pairs:
            assert tp_loss == pytest.approx(one_loss, abs=1e-5), name


def test_tp2_trainer_logs_the_one_process_losses_and_learns(tmp_path):
    flags = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--training.steps",
        "20",
    ]
    one = run_titanlite([*flags, "--job.dump_folder", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    tp_flags = [*flags, "--job.dump_folder", str(tmp_path / "tp"), "--parallelism.tensor_parallel_degree", "2"]
    tp = run_titanlite(tp_flags, nproc=2)
    assert tp.returncode == 0, tp.stderr
    # Gradients included: the embedding's gradient comes back whole from its backward and is cut to
    # this rank's rows at once (tp.place_grads_like_params); without that, grads here were 12,915,712 B.
    assert_planned_state(tp_flags, 2, tp.stderr)
    assert "mesh dp_replicate 1 x dp_shard 1 x tp 2, pp 1" in tp.stderr
    expected, got = logged_losses(one.stderr), logged_losses(tp.stderr)
    for step in range(1, 6):
        assert got[step] == pytest.approx(expected[step], abs=1e-4)  # as printed: 4 decimals
    assert got[20] < got[1] - 1.0, got


@pytest.mark.parametrize(
    "degrees, world, message",
    [
        (
            {"tensor_parallel_degree": 2},
            3,
            "data_parallel_replicate_degree 1 x context_parallel_degree 1 x tensor_parallel_degree 2 x "
            "pipeline_parallel_degree 1 = 2 do not divide the world size 3",
        ),
        ({"tensor_parallel_degree": 2, "data_parallel_shard_degree": 2}, 2, "= 4 do not match the world size 2"),
    ],
)
def test_impossible_degrees_are_one_sentence(degrees, world, message):
    with pytest.raises(UserError, match=re.escape(message)):
        ParallelDims.from_config(Parallelism(**degrees), world)


@pytest.mark.parametrize(
    "name, flavor, tp, what",
    [
        ("llama3", "debugmodel", 3, "attention heads (n_heads) 16"),
        ("mistral", "debugmodel", 16, "key/value heads (n_kv_heads) 8"),
        ("llama3", "8B", 5, "attention heads (n_heads) 32"),
    ],
)
def test_tp_must_divide_the_model_shapes(name, flavor, tp, what):
    args = get_model_args(get_model_spec(name), flavor)
    with pytest.raises(UserError, match=re.escape(f"tensor_parallel_degree {tp} does not divide the model's {what}")):
        ParallelDims(1, 1, tp=tp).check_model(args)


def test_tp_must_divide_experts_and_vocab():
    mixtral = dataclasses.replace(
        get_model_args(get_model_spec("mixtral"), "debugmodel"), vocab_size=2256, num_experts=6
    )
    with pytest.raises(
        UserError, match=re.escape("tensor_parallel_degree 4 does not divide the model's experts (num_experts) 6")
    ):
        ParallelDims(1, 1, tp=4).check_model(mixtral)
    gpt2 = get_model_args(get_model_spec("gpt2"), "124M")  # 12 heads, FFN 3072, an odd vocabulary
    with pytest.raises(UserError, match="vocabulary size 50257"):
        ParallelDims(1, 1, tp=2).check_model(gpt2)


def test_async_tp_needs_cuda_compile_and_tp():
    """Async TP is inductor's micro-pipelining on CUDA symmetric memory: refused elsewhere in one sentence."""
    with pytest.raises(
        UserError, match=r"enable_async_tensor_parallel needs CUDA and compile.enable \(this run: cpu, compile on\)"
    ):
        check_tensor_parallel(Parallelism(tensor_parallel_degree=2, enable_async_tensor_parallel=True), "cpu", True)
    with pytest.raises(UserError, match=r"needs CUDA and compile.enable \(this run: cuda, compile off\)"):
        check_tensor_parallel(Parallelism(tensor_parallel_degree=2, enable_async_tensor_parallel=True), "cuda", False)
    with pytest.raises(
        UserError, match="enable_async_tensor_parallel needs parallelism.tensor_parallel_degree above 1"
    ):
        check_tensor_parallel(Parallelism(enable_async_tensor_parallel=True), "cuda", True)
    check_tensor_parallel(Parallelism(tensor_parallel_degree=2, enable_async_tensor_parallel=True), "cuda", True)


def test_refused_layout_exits_2_without_traceback(tiny_run):
    out = run_titanlite([*tiny_run, "--parallelism.tensor_parallel_degree", "2"])
    assert out.returncode == 2
    assert (
        "error: parallelism degrees data_parallel_replicate_degree 1 x context_parallel_degree 1 x "
        "tensor_parallel_degree 2" in out.stderr
    )
    assert "Traceback" not in out.stderr


@pytest.mark.extended
def test_checkpoint_saved_under_tp2_resumes_on_one_process(tmp_path):
    """DCP reshards the TP DTensors (model and optimizer) into plain tensors: the resumed steps
    are the uninterrupted run's. Both layouts have one data-parallel rank, so the data position carries over."""
    flags = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
    ]
    tp = run_titanlite([*flags, "--parallelism.tensor_parallel_degree", "2"], nproc=2)
    assert tp.returncode == 0, tp.stderr
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    resumed = run_titanlite(flags)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step-3" in resumed.stderr
    uninterrupted, after = logged_losses(tp.stderr), logged_losses(resumed.stderr)
    assert sorted(after) == [4, 5, 6]
    for step in after:
        assert after[step] == pytest.approx(uninterrupted[step], abs=1e-4)


# FSDP2 x TP2 on four ranks shares the 4-process launch of tests/test_pipeline_parallel.py.
