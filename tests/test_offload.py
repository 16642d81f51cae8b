"""Offloading: FSDP2's CPU offload of params/grads/optimizer state, and activation offload."""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import run_titanlite, tensorboard_scalars

from titanlite.errors import UserError
from titanlite.parallel.offload import HeldBytes, OffloadActivations, activation_offload_context, check_fsdp_offload


def synthetic_run(folder, local_batch, extra=()):
    return [
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
        "3",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--training.mixed_precision_param",
        "float32",
        *extra,
    ]


@pytest.mark.extended
def test_two_ranks_with_cpu_offload_equal_one_process(tmp_path):
    """Same global batch of 4; the offloaded FSDP run steps its optimizer on the CPU shards."""
    one = run_titanlite(synthetic_run(tmp_path / "one", 4))
    assert one.returncode == 0, one.stderr
    two = run_titanlite(
        synthetic_run(
            tmp_path / "two", 2, ["--parallelism.fsdp_cpu_offload", "--activation_checkpoint.offload_activations"]
        ),
        nproc=2,
    )
    assert two.returncode == 0, two.stderr
    assert "activations already live in CPU memory" in two.stderr
    assert "activation_offload: peak" in two.stderr and "(no memory saved on a CPU run)" in two.stderr
    assert int(re.search(r"activation_offload_peak (\d+)", two.stderr).group(1)) > 0
    assert "activation_offload" not in one.stderr
    expected = tensorboard_scalars(tmp_path / "one" / "tb", "loss/train")
    got = tensorboard_scalars(tmp_path / "two" / "tb", "loss/train")
    assert sorted(got) == [1, 2, 3]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5)


def test_fsdp_offload_without_fsdp_is_refused():
    with pytest.raises(UserError, match="needs FSDP, i.e. more than one data-parallel rank"):
        check_fsdp_offload(True, fsdp_enabled=False)
    check_fsdp_offload(True, fsdp_enabled=True)
    check_fsdp_offload(False, fsdp_enabled=False)


def test_activation_offload_gives_the_same_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    grads = []
    for enabled in (False, True):
        layer.zero_grad()
        with activation_offload_context(HeldBytes() if enabled else None):
            loss = F.mse_loss(layer(x), torch.zeros(4, 8))
        loss.backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for plain, offloaded in zip(*grads):
        torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)


def test_pinned_memory_only_with_cuda(monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from titanlite.parallel.offload import fsdp_offload_policy

    assert type(fsdp_offload_policy(False)) is OffloadPolicy
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run (job.device cpu hides the GPUs)
    assert fsdp_offload_policy(True).pin_memory is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    policy = fsdp_offload_policy(True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is True


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.transpose(1, 2),  # what a compiled backward saw come back contiguous (issue 17)
        lambda x: x[:, 1::2, 3:],  # gaps and an offset
        lambda x: x[1:, :1].expand(3, 5, 6),  # stride 0
        lambda x: x.permute(2, 0, 1).contiguous(),
    ],
    ids=["transposed", "strided-slice", "expanded", "contiguous"],
)
def test_offloaded_tensor_comes_back_with_its_size_and_strides(view):
    tensor = view(torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6))
    hooks = OffloadActivations(HeldBytes())
    packed = hooks.pack(tensor)
    back = hooks.unpack(packed)
    assert back.shape == tensor.shape and back.stride() == tensor.stride() and torch.equal(back, tensor)
    assert back.storage_offset() == 0  # rebuilt from the elements the view reaches, not its whole storage
    assert back.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()  # a copy, not the tensor
    assert torch.equal(hooks.unpack(packed), tensor)  # again, as with retain_graph


def test_parameters_are_not_offloaded():
    weight = torch.nn.Parameter(torch.ones(3))
    held = HeldBytes()
    hooks = OffloadActivations(held)
    assert hooks.pack(weight) is weight
    transposed = weight.view(1, 3).t()  # a Linear saves its weight transposed
    assert hooks.pack(transposed) is transposed
    assert held.peak == 0


def test_held_bytes_count_what_backward_will_need_and_return_to_zero():
    """Each Linear saves its [4, 16] fp32 input (and its weight, which stays), each ReLU its [4, 16]
    output, which is also the next Linear's input: 4 tensors of 256 bytes (the input and the three
    ReLU outputs), all held from the forward until their backward; after it, none."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[module for _ in range(3) for module in (torch.nn.Linear(16, 16), torch.nn.ReLU())])
    held = HeldBytes()
    for _ in range(2):  # a second step counts the same, not more
        with activation_offload_context(held):
            loss = layers(torch.randn(4, 16, requires_grad=True)).sum()
        assert held.live == 4 * 4 * 16 * 4
        loss.backward()
        assert held.live == 0
    assert held.peak == 4 * 4 * 16 * 4


def test_a_tensor_saved_by_several_ops_is_copied_once_and_serves_them_all():
    """q, k and v projections all save the same normed input (as Attention's wq, wk, wv do): one host
    copy, counted once, and the same gradients as without offload."""
    torch.manual_seed(0)
    norm, projections = torch.nn.LayerNorm(16), torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
    x = torch.randn(4, 16)
    grads, held = [], HeldBytes()
    for offloaded in (None, held):
        for p in [*norm.parameters(), *projections.parameters()]:
            p.grad = None
        with activation_offload_context(offloaded):
            h = norm(x)
            loss = sum((projection(h) ** 2).sum() for projection in projections)
        loss.backward()
        grads.append([p.grad.clone() for p in [*norm.parameters(), *projections.parameters()]])
    for plain, offloaded in zip(*grads):
        torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)
    # Saved: h once for the three projections, their three outputs (for ** 2), and the norm's
    # input (x, 256 bytes) with its mean and rstd ([4, 1] each, 16 bytes).
    assert held.peak == 256 + 3 * 256 + 256 + 2 * 16, held.peak
    assert held.live == 0
