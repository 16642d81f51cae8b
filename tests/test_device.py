"""Device choice and the CUDA allocator default (parallel/dist.py): the decisions, on any machine."""

import os

import pytest
from conftest import DEBUG_CONFIG, run_titanlite

from titanlite.errors import UserError
from titanlite.parallel.dist import (
    EXPANDABLE_SEGMENTS,
    choose_device_type,
    default_allocator_setting,
    use_default_allocator,
)


def test_allocator_default_only_where_the_user_chose_none():
    assert default_allocator_setting({}) == EXPANDABLE_SEGMENTS == "expandable_segments:True"
    assert default_allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == ""
    assert default_allocator_setting({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == ""  # torch 2.9+'s name


def test_a_users_allocator_setting_is_kept(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert use_default_allocator() == ""
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    note = use_default_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert note.startswith("PYTORCH_CUDA_ALLOC_CONF is not set: using expandable_segments:True")


@pytest.mark.parametrize(
    "requested, gpus, local_rank, local_world, expected",
    [
        ("auto", 0, 0, 1, "cpu"),
        ("auto", 1, 0, 1, "cuda"),
        ("auto", 8, 7, 8, "cuda"),
        ("cpu", 8, 1, 2, "cpu"),  # CPU ranks on a GPU machine
        ("cuda", 2, 1, 2, "cuda"),
    ],
)
def test_device_choice(requested, gpus, local_rank, local_world, expected):
    assert choose_device_type(requested, gpus, local_rank, local_world) == expected


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_more_local_ranks_than_gpus_is_one_sentence(requested):
    with pytest.raises(UserError) as error:
        choose_device_type(requested, gpus=1, local_rank=0, local_world_size=2)
    assert str(error.value) == (
        "2 processes on this machine but 1 visible GPU (one process per GPU): launch with torchrun --nproc_per_node 1, "
        "make more GPUs visible with CUDA_VISIBLE_DEVICES, or run on the CPU with --job.device cpu"
    )


def test_cuda_without_a_gpu_exits_2_with_one_line(tmp_path):
    """No GPU visible (CUDA_VISIBLE_DEVICES empty), so this is the same on a GPU machine."""
    out = run_titanlite(
        ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path), "--job.device", "cuda"],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: job.device cuda, but this process sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES); "
        "set job.device auto or cpu to run on the CPU"
    ]
