"""Multi-process runs under torchrun on CPU (gloo): FSDP, HSDP, gradient accumulation."""

import pytest
from conftest import assert_planned_state, logged_losses, run_titanlite, tensorboard_scalars


def synthetic_run(tmp_path, name, local_batch, steps=4, extra=()):
    folder = tmp_path / name
    return folder, [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(folder),
        "--training.dataset",
        "synthetic",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        str(local_batch),
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--training.mixed_precision_param",
        "float32",
        *extra,
    ]


def test_fsdp_two_ranks_equals_one_process(tmp_path):
    """Same global batch of 4: one process with 4, or two FSDP ranks with 2 each."""
    one_dir, one = synthetic_run(tmp_path, "one", local_batch=4)
    two_dir, two = synthetic_run(tmp_path, "two", local_batch=2)
    first = run_titanlite(one)
    assert first.returncode == 0, first.stderr
    second = run_titanlite(two, nproc=2)
    assert second.returncode == 0, second.stderr
    single = tensorboard_scalars(one_dir / "tb", "loss/train")
    sharded = tensorboard_scalars(two_dir / "tb", "loss/train")
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4]
    for step in single:
        assert sharded[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5)
    assert "mesh dp_replicate 1 x dp_shard 2" in second.stderr
    assert_planned_state(one, 1, first.stderr)
    assert_planned_state(two, 2, second.stderr)


def test_gradient_accumulation_equals_the_big_batch(tmp_path):
    """Two ranks: local 2 x 2 micro-steps gives the losses of local 4.

    The accumulating run also keeps gathered parameters between forward and backward
    (reshard_after_forward never), which must change memory, not numbers.
    """
    big_dir, big = synthetic_run(tmp_path, "big", local_batch=4)
    acc_dir, acc = synthetic_run(
        tmp_path,
        "acc",
        local_batch=2,
        extra=["--training.global_batch_size", "8", "--parallelism.fsdp_reshard_after_forward", "never"],
    )
    assert run_titanlite(big, nproc=2).returncode == 0
    out = run_titanlite(acc, nproc=2)
    assert out.returncode == 0, out.stderr
    assert "(2 micro-steps)" in out.stderr
    expected = tensorboard_scalars(big_dir / "tb", "loss/train")
    got = tensorboard_scalars(acc_dir / "tb", "loss/train")
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("replicate", ["1", pytest.param("2", marks=pytest.mark.extended)], ids=["fsdp", "hsdp-2x1"])
def test_two_ranks_learn_on_the_sample_corpus(tmp_path, replicate):
    flags = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "128",
        "--training.steps",
        "16",
        "--metrics.log_freq",
        "1",
        "--parallelism.data_parallel_replicate_degree",
        replicate,
    ]
    out = run_titanlite(flags, nproc=2)
    assert out.returncode == 0, out.stderr
    losses = logged_losses(out.stderr)
    assert sorted(losses) == list(range(1, 17))
    assert losses[16] < losses[1] - 1.0, losses
    assert "[rank1]" not in out.stderr  # rank 1 speaks only for warnings and errors
    assert_planned_state(flags, 2, out.stderr)


def test_impossible_degrees_name_degrees_and_world(tmp_path):
    out = run_titanlite(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--parallelism.data_parallel_replicate_degree",
            "3",
        ],
        nproc=2,
        fresh_ranks=True,
    )
    assert out.returncode != 0
    assert (
        "error: parallelism degrees data_parallel_replicate_degree 3 x context_parallel_degree 1 x "
        "tensor_parallel_degree 1 x pipeline_parallel_degree 1 = 3 do not divide the world size 2"
    ) in out.stderr
