"""The cuda tier: the real GPU code paths, each a few seconds on one H100 (skipped, with the reason,
without a CUDA GPU; see the `cuda` marker in conftest.py). Runs pin `--job.device cuda`, so a broken
driver fails here instead of quietly training on the CPU."""

import contextlib
import copy
import dataclasses
import importlib.util
import math
import os
import pickle
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, run_titanlite, tensorboard_scalars

from titanlite.parallel.dist import default_allocator_setting
from titanlite.parallel.offload import HeldBytes, OffloadActivations

pytestmark = pytest.mark.cuda
users_allocator = pytest.mark.skipif(
    default_allocator_setting(os.environ) == "", reason="PYTORCH_CUDA_ALLOC_CONF is set here, so titanlite keeps it"
)


def gpu_flags(folder, steps: int = 4, *extra) -> list[str]:
    """The debug model on synthetic tokens, on the GPU, deterministic kernels (so reruns are bit-equal)."""
    return [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(folder),
        "--job.device",
        "cuda",
        "--training.dataset",
        "synthetic",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--training.deterministic",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--lr_scheduler.min_lr_factor",
        "1",
        *map(str, extra),
    ]


def trained(folder, *extra, steps: int = 4, tb: str = "tb", first: int = 1) -> dict[int, float]:
    out = run_titanlite(gpu_flags(folder, steps, "--metrics.save_tb_folder", tb, *extra), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "world 1 on cuda" in out.stderr, out.stderr[-2000:]
    losses = tensorboard_scalars(folder / tb, "loss/train")
    assert sorted(losses) == list(range(first, steps + 1)) and all(math.isfinite(v) for v in losses.values()), losses
    return losses


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("compiled"), "--compile.enable")


def test_compiled_steps_match_eager(eager, compiled):
    assert compiled == pytest.approx(eager, rel=1e-3)


def test_activation_offload_is_exact_in_eager(tmp_path, eager):
    assert trained(tmp_path, "--activation_checkpoint.offload_activations") == eager


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_activation_offload_under_compile(tmp_path, compiled, ac):
    """Crashed in backward (saved tensors came back contiguous: `expected ... stride 524288==64`)."""
    losses = trained(
        tmp_path, "--compile.enable", "--activation_checkpoint.offload_activations", "--activation_checkpoint.mode", ac
    )
    assert losses == pytest.approx(compiled, rel=1e-4)


def test_offloaded_tensors_come_back_with_their_strides_and_gradients():
    """In process, on the side stream: more saved tensors than the prefetch window, transposed views."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(12)]
    ).cuda()
    x = torch.randn(32, 64, device="cuda")
    grads = []
    for offload in (False, True):
        layers.zero_grad()
        with OffloadActivations(HeldBytes()) if offload else contextlib.nullcontext():
            loss = F.mse_loss(layers(x).t().contiguous().t(), torch.zeros(32, 64, device="cuda"))
        loss.backward()
        grads.append([p.grad.clone() for p in layers.parameters()])
    for plain, offloaded in zip(*grads):
        torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)
    hooks = OffloadActivations(HeldBytes())
    view = torch.arange(24.0, device="cuda").reshape(2, 3, 4).transpose(0, 2)
    back = hooks.unpack(hooks.pack(view))
    assert back.is_cuda and back.stride() == view.stride() and torch.equal(back, view)


def test_activation_offload_frees_device_memory_it_reports():
    """12 Linear + GELU pairs save 24 [4096, 1024] fp32 tensors (16 MiB each): offloaded, the peak
    device memory of forward + backward drops by most of what HeldBytes reports held in host memory
    (the prefetch window of 8 tensors comes back early, by design)."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(12)]
    ).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    peaks, held = [], HeldBytes()
    for offload in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with OffloadActivations(held) if offload else contextlib.nullcontext():
            loss = layers(x).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        layers.zero_grad(set_to_none=True)
    assert held.live == 0 and held.peak >= 24 * 16 * 2**20
    assert peaks[0] - peaks[1] >= held.peak / 2, (peaks, held.peak)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="float8 needs torchao (pip install torchao)")
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="float8 needs compute capability 8.9 or newer",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_converts_and_trains(tmp_path, compiled, recipe):
    losses = trained(
        tmp_path,
        "--compile.enable",
        "--float8.enable",
        "--float8.recipe_name",
        recipe,
        "--training.mixed_precision_param",
        "bfloat16",
    )
    assert losses == pytest.approx(compiled, rel=0.05)  # float8 matmuls: close to the fp32 run, not equal


def test_pure_bf16_training_with_the_kahan_optimizer_tracks_fp32(tmp_path, eager):
    """bf16 weights and states, AdamWBF16Kahan's compiled (Triton) update inside the trainer: 4 steps' losses
    within 2% of the fp32 run's (bf16 matmuls and weights, not equal), and the run resumes exactly."""
    flags = [
        "--training.param_dtype",
        "bfloat16",
        "--training.mixed_precision_param",
        "bfloat16",
        "--optimizer.name",
        "AdamWBF16Kahan",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    losses = trained(tmp_path, *flags)
    assert losses == pytest.approx(eager, rel=0.02)
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    assert trained(tmp_path, *flags, tb="resumed", first=3) == {s: losses[s] for s in (3, 4)}


def test_async_pinned_save_resumes_exactly(tmp_path):
    """Also the CLI's exit on the GPU (parallel/dist.py exit_process, os._exit after the threads and exit
    handlers): exit 0, with the last step's pinned asynchronous save complete on disk."""
    flags = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async_with_pinned_mem"]
    reference = trained(tmp_path, *flags, steps=6)
    assert (tmp_path / "checkpoint" / "step-6" / ".metadata").is_file()
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    resumed = trained(tmp_path, *flags, steps=6, tb="resumed", first=4)
    assert resumed == {s: reference[s] for s in (4, 5, 6)}


def test_pinned_staging_reuses_its_buffers_and_waits_for_the_step():
    """checkpoint/async_save.py's HostStaging on the GPU: pinned host buffers made at the first copy and reused by the
    next, each copy made on the side stream after the event that marks the state as computed."""
    from titanlite.checkpoint.async_save import HostStaging, host_tensors

    staging = HostStaging(pinned=True)
    weight = torch.zeros(1024, 1024, device="cuda")
    for value in (1.0, 2.0):
        weight.fill_(value)  # queued on the training stream; the copy must wait for it
        computed = torch.cuda.Event()
        computed.record()
        host = staging.copy({"model": {"w": weight}, "step": int(value)}, computed)
        if value == 1.0:
            first = [t.data_ptr() for t in host_tensors(staging.buffers)]
        assert host["model"]["w"].is_pinned() and host["step"] == int(value)
        assert torch.equal(host["model"]["w"], torch.full((1024, 1024), value))
    assert [t.data_ptr() for t in host_tensors(staging.buffers)] == first


@users_allocator
def test_memory_snapshot_with_the_allocator_default(tmp_path):
    trained(tmp_path, "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2", steps=2)
    with open(tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle", "rb") as file:
        snapshot = pickle.load(file)
    assert snapshot["segments"] and snapshot["device_traces"][0]  # the history was recorded
    assert snapshot["allocator_settings"]["expandable_segments"] is True  # the default titanlite set


@users_allocator
def test_eager_1b_shape_trains_with_expandable_segments(tmp_path):
    """The shape that ran out of memory by fragmentation at step 1 (1B, seq 8192, batch 2, eager, bf16),
    on 2 of its 16 layers so that it takes seconds."""
    out = run_titanlite(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--job.device",
            "cuda",
            "--model.flavor",
            "1B",
            "--model.n_layers",
            "2",
            "--training.dataset",
            "synthetic",
            "--training.seq_len",
            "8192",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "3",
            "--training.mixed_precision_param",
            "bfloat16",
            "--metrics.log_freq",
            "1",
        ],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "PYTORCH_CUDA_ALLOC_CONF is not set: using expandable_segments:True" in out.stderr
    assert "step: 3  loss:" in out.stderr


def test_more_processes_than_gpus_is_one_sentence(tmp_path):
    visible = torch.cuda.device_count()
    out = run_titanlite(
        gpu_flags(tmp_path, 1, "--job.device", "auto"), nproc=visible + 1, timeout=300, fresh_ranks=True
    )
    assert out.returncode != 0
    assert (f"error: {visible + 1} processes on this machine but {visible} visible GPU") in out.stderr, out.stderr[
        -3000:
    ]
    assert "titanlite/" not in "".join(line for line in out.stderr.splitlines() if line.strip().startswith("File "))


def test_cpu_ranks_on_a_gpu_machine(tmp_path):
    """job.device cpu hides the GPUs: two gloo ranks train even where there are fewer GPUs than ranks."""
    out = run_titanlite(gpu_flags(tmp_path, 2, "--job.device", "cpu"), nproc=2, fresh_ranks=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "world 2 on cpu" in out.stderr


def test_block_causal_flex_attention_equals_the_cpu_mask_path():
    """On CUDA a document mask runs compiled FlexAttention; on CPU SDPA with the same rule as a dense
    mask. Mistral's window (16) composes with the documents; 200 tokens is no multiple of flex's 128 blocks."""
    from conftest import materialize
    from torch.nn.attention.flex_attention import BlockMask

    from titanlite.models import get_model_args, get_model_spec
    from titanlite.models.attention import attention_mask, document_ids

    args = dataclasses.replace(
        get_model_args(get_model_spec("mistral"), "debugmodel"),
        vocab_size=97,
        n_layers=2,
        max_seq_len=256,
        sliding_window=16,
    )
    cpu = materialize("mistral", args)
    gpu = copy.deepcopy(cpu).cuda()
    tokens = torch.randint(2, 97, (2, 201), generator=torch.Generator().manual_seed(0))
    tokens[0, 30] = tokens[0, 90] = tokens[1, 150] = 0  # bos: 3 + 2 documents
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ids = document_ids(inputs, (0, 1))
    assert isinstance(attention_mask(ids.cuda(), 16, torch.device("cuda")), BlockMask)
    losses = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        logits = model(inputs.to(device), document_ids=ids.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten())
        loss.backward()
        losses.append((logits.detach().cpu(), loss.item()))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-4, atol=1e-4)
    assert losses[1][1] == pytest.approx(losses[0][1], abs=1e-5)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("window, documents", [(None, True), (100, True), (None, False)])
def test_context_parallel_flex_attention_equals_the_cpu_path(window, documents):
    """Context parallelism's mask on CUDA is a FlexAttention BlockMask over this rank's queries and the
    gathered keys (rank by rank, not in sequence order), with or without documents; 4 ranks' rows and the
    gradients equal the CPU dense-mask path (tests/test_cp.py plays the ranks in one process). 512 tokens:
    64-token chunks; heads of 16 (FlexAttention's smallest on CUDA under torch 2.11)."""
    from test_cp import attention_inputs, sharded_attention

    results = []
    for device in ("cpu", "cuda"):
        q, k, v, ids = attention_inputs(device, seq_len=512, head_dim=16)
        out = sharded_attention(q, k, v, ids if documents else None, window, cp=4)
        results.append((out.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(out.square().sum(), (q, k, v)))))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "extra", [[], ["--compile.enable", "--activation_checkpoint.mode", "selective"]], ids=["eager", "compiled-op-ac"]
)
def test_block_causal_trains_on_documents(tmp_path, extra):
    """The default mask on the sample corpus (several documents per 256-token window) through the trainer."""
    losses = trained(tmp_path, "--training.dataset", "sample", "--model.reset_position_ids", *extra)
    assert losses[4] < losses[1]


def test_the_cuda_graph_token_step_gives_the_eager_tokens(tmp_path):
    """titanlite.load(compile=True) on CUDA: the whole token step (forward, sampling, bookkeeping) compiled, captured
    as a CUDA graph at each call's second step and replayed after; greedy and sampled, its tokens are the eager
    step's and its log-probabilities within 1e-4."""
    from test_generate import PROMPTS, transformers_folder

    from titanlite.examples.chat_example import write_tokenizer_folder
    from titanlite.inference.load import load

    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, write_tokenizer_folder(tmp_path / "tokenizer"))
    eager, graphed = load(folder, device="cuda"), load(folder, device="cuda", compile=True)
    assert graphed.cuda_graph and not eager.cuda_graph
    for sampling in ({}, {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 3}):
        expected = eager.generate(PROMPTS, max_new_tokens=40, ignore_eos=True, **sampling)
        got = graphed.generate(PROMPTS, max_new_tokens=40, ignore_eos=True, **sampling)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        for ours, theirs in zip(got, expected):
            assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
