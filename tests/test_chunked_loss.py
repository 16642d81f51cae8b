"""training.loss_chunk_tokens: the chunked output projection + cross-entropy against the plain logits
path, alone (loss and gradients), in the trainer (llama3, gpt2's tied output, mixtral; FSDP on 2
ranks; validation), its refusals, and the planner's activation peak."""

import pytest
import torch
from conftest import ROOT, tensorboard_scalars
from test_pipeline_parallel import launch, run

from titanlite.config import load_config
from titanlite.loss import chunk_loss, chunked_cross_entropy, cross_entropy_loss
from titanlite.models import get_model_spec
from titanlite.parallel.dims import ParallelDims
from titanlite.plan.activations import activations
from titanlite.plan.job import model_args
from titanlite.train import main

N, D, V = 300, 64, 1000


def loss_and_grads(loss_fn, dtype):
    """loss_fn(h, weight) with h [N, D] and weight [V, D] drawn in float64 and cast to dtype, and the
    gradients of both; all returned in float64."""
    torch.manual_seed(0)
    h = torch.randn(N, D, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, dtype=torch.float64) * D**-0.5).to(dtype).requires_grad_()
    loss = loss_fn(h, weight)
    loss.backward()
    return [t.detach().double() for t in (loss, h.grad, weight.grad)]


def unfused(h, weight, labels):
    return cross_entropy_loss((h @ weight.T)[None], labels[None])


def relative(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_loss_and_gradients_equal_the_logits_path_in_fp32():
    """Chunks that divide N, that do not, and of N or more tokens. Reached: the loss within 1.3e-7
    relative, the gradients within 3.2e-7 (max difference / max value), except h's in chunks of 7 tokens,
    1.6e-6: a 7-row GEMM rounds its sums differently from a 300-row one."""
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    want = loss_and_grads(lambda h, w: unfused(h, w, labels), torch.float32)
    for chunk in (60, 7, N, 4096):
        got = loss_and_grads(lambda h, w: chunked_cross_entropy(h, w, labels, chunk), torch.float32)
        assert relative(got[0], want[0]) <= 1e-6, chunk
        assert relative(got[1], want[1]) <= 2e-6 and relative(got[2], want[2]) <= 2e-6, chunk


def test_bf16_is_close_to_the_bf16_logits_path():
    """bf16 h and weight: the loss within 1e-6 relative of the plain bf16 path (reached 6.4e-8), the
    gradient of h within 2**-8 (reached 0: the same bf16 GEMMs) and the weight's within 2**-7, one bf16
    step at its largest value (reached 5.9e-3: each path rounds its sum to bf16 once, from different partial sums)."""
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    plain = loss_and_grads(lambda h, w: unfused(h, w, labels), torch.bfloat16)
    chunked = loss_and_grads(lambda h, w: chunked_cross_entropy(h, w, labels, 64), torch.bfloat16)
    assert relative(chunked[0], plain[0]) <= 1e-6
    assert relative(chunked[1], plain[1]) <= 2**-8 and relative(chunked[2], plain[2]) <= 2**-7


class Recording:
    """chunk_loss as it is, noting the grad_scale of every call (None: no gradient computed)."""

    def __init__(self):
        self.scales = []

    def __call__(self, logits, labels, grad_scale=None):
        self.scales.append(grad_scale)
        return chunk_loss(logits, labels, grad_scale)


def test_without_grad_no_gradient_is_computed():
    recording = Recording()
    scales = recording.scales
    h, weight = torch.randn(N, D), torch.randn(V, D, requires_grad=True)  # a parameter, as in validation
    labels = torch.randint(0, V, (N,))
    with torch.no_grad():
        loss = chunked_cross_entropy(h, weight, labels, 128, recording)
    assert scales == [None, None, None] and not loss.requires_grad
    assert loss.item() == pytest.approx(unfused(h, weight, labels).item(), rel=1e-6)
    chunked_cross_entropy(h, weight, labels, 128, recording).backward()
    assert scales[3:] == [1 / N] * 3 and weight.grad is not None


@pytest.mark.extended
def test_trainer_with_chunks_equals_without_for_llama3_gpt2_mixtral_and_on_two_fsdp_ranks(
    tmp_path, monkeypatch, capsys
):
    """fp32 TensorBoard losses within 1e-6 at every step, 128 tokens a micro-batch in chunks of 50
    (not a divisor): llama3 (untied output) with validation, gpt2 (tied: the embedding gets both
    gradients), mixtral (its balance loss still reaches the routers). Then gpt2 on 2 FSDP ranks (the
    tied weight gathered and its gradient reduce-scattered by the root) equals the 1-process run."""
    base = ["--training.local_batch_size", "2", "--training.dataset", "synthetic"]  # and run()'s: seq 64, TensorBoard
    validated = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    models = {"llama3": validated, "gpt2": ["--model.name", "gpt2"], "mixtral": ["--model.name", "mixtral"]}
    recording = Recording()
    monkeypatch.setattr("titanlite.loss.chunk_loss", recording)  # what build_loss hands the model
    for name, flags in models.items():
        for chunk in ("0", "50"):
            assert (
                main(
                    run(tmp_path, f"{name}_{chunk}", [*base, *flags, "--training.loss_chunk_tokens", chunk], 3)["argv"]
                )
                == 0
            )
    # 3 chunks a micro-batch (50 + 50 + 28 tokens): 3 training steps x 3 models, llama3's 2 validation batches.
    assert recording.scales.count(1 / 128) == 27 and recording.scales.count(None) == 6
    assert capsys.readouterr().err.count("| loss chunks 50 tokens |") == 3
    for name in models:
        for tag in ("loss/train", *(["loss/validation"] if name == "llama3" else [])):
            plain, chunked = (tensorboard_scalars(tmp_path / f"{name}_{c}" / "tb", tag) for c in ("0", "50"))
            assert sorted(chunked) == sorted(plain) and plain, (name, tag)
            for step, value in plain.items():
                assert chunked[step] == pytest.approx(value, rel=1e-6), (name, tag, step)
    fsdp = ["--model.name", "gpt2", "--training.local_batch_size", "1", "--training.global_batch_size", "2"]
    launch([run(tmp_path, "gpt2_fsdp2", [*base, *fsdp, "--training.loss_chunk_tokens", "50"], 3)], 2, tmp_path, "fsdp2")
    one, two = (tensorboard_scalars(tmp_path / name / "tb", "loss/train") for name in ("gpt2_0", "gpt2_fsdp2"))
    assert sorted(two) == [1, 2, 3]
    for step, value in two.items():
        assert value == pytest.approx(one[step], abs=1e-5), step


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--parallelism.tensor_parallel_degree", "2"],
            "is not supported with parallelism.tensor_parallel_degree 2 yet (the output projection is vocab-sharded",
        ),
        (
            ["--float8.enable", "--float8.filter_fqns", "wq"],
            "multiplies by the output weight in the compute dtype, but float8.filter_fqns wq lets float8 convert the "
            "output layer",
        ),
    ],
)
def test_tensor_parallelism_and_float8_output_are_refused_in_one_sentence(tiny_run, flags, message, capsys):
    assert main([*tiny_run, "--training.loss_chunk_tokens", "4096", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: training.loss_chunk_tokens 4096 {message}")
    assert lines[0].endswith("set training.loss_chunk_tokens 0")


def test_planner_peak_drops_by_at_least_the_fp32_logits():
    """GPT-2 124M cut to 2 blocks, 2 x 1024 tokens, bf16: the logits (50,257 wide) dominate its
    activations. Measured: 1396 MiB of peak without, 499 MiB with chunks of 256 tokens (the fp32 logits: 393 MiB)."""
    tokens = 2 * 1024
    peaks = {}
    for chunk in (0, 256):
        cfg = load_config(
            [
                "--job.config_file",
                str(ROOT / "train_configs" / "debug_model.toml"),
                "--model.name",
                "gpt2",
                "--model.flavor",
                "124M",
                "--model.n_layers",
                "2",
                "--training.seq_len",
                "1024",
                "--training.local_batch_size",
                "2",
                "--training.mixed_precision_param",
                "bfloat16",
                "--training.loss_chunk_tokens",
                str(chunk),
            ]
        )
        spec = get_model_spec("gpt2")
        peaks[chunk] = activations(cfg, spec, model_args(cfg, spec), ParallelDims(1, 1)).peak
    assert peaks[0] - peaks[256] >= tokens * 50257 * 4, peaks


@pytest.mark.cuda
def test_on_cuda_compiled_chunks_equal_the_logits_path_and_hold_less_than_the_fp32_logits():
    """Llama 3.2 1B's output layer (vocab 128,256, dim 2048), 8192 tokens in bf16, the chunk math
    compiled as compile.components "loss" has it: the loss and gradients as the plain bf16 path's, and
    a peak at least the fp32 logits (3.9 GiB) below the plain path's."""
    torch.manual_seed(0)
    n, d, v = 8192, 2048, 128256
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device="cuda") * d**-0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    compiled = torch.compile(chunk_loss)

    def step(loss_fn):
        h.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = loss_fn()
        loss.backward()
        return loss.item(), h.grad, weight.grad, torch.cuda.max_memory_allocated() - before

    chunked = lambda: chunked_cross_entropy(h, weight, labels, 2048, compiled)  # noqa: E731
    step(chunked)  # compiles
    plain = step(lambda: unfused(h, weight, labels))
    got = step(chunked)
    assert got[0] == pytest.approx(plain[0], rel=1e-4)
    assert (
        relative(got[1].double(), plain[1].double()) <= 2**-7 and relative(got[2].double(), plain[2].double()) <= 2**-6
    )
    assert got[3] <= plain[3] - n * v * 4, (got[3], plain[3])
