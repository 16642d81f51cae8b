"""torch.compile of the blocks and the loss: same losses as eager, same FQNs, one graph for all blocks."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import run_titanlite, tensorboard_scalars

from titanlite.config import load_config
from titanlite.config_sections import ActivationCheckpoint, Compile
from titanlite.errors import UserError
from titanlite.loss import maybe_compile_loss
from titanlite.models.attention import document_ids
from titanlite.models.llama.args import LLAMA3_FLAVORS
from titanlite.models.llama.model import Transformer
from titanlite.parallel.ac import apply_ac
from titanlite.parallel.compile import apply_compile


def synthetic_run(folder, extra=()):
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
        "2",
        "--training.steps",
        "3",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        *extra,
    ]


def test_compiled_debug_model_matches_eager(tmp_path):
    """The default backend (inductor), blocks and loss; the in-loop evaluation's sample prompts decode through the
    compiled blocks eagerly (compiled, a decode step per token recompiled them past dynamo's limit)."""
    eager = run_titanlite(synthetic_run(tmp_path / "eager"))
    assert eager.returncode == 0, eager.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n')
    samples = ["--eval.sample_prompts", str(prompts), "--eval.at_end", "--eval.max_new_tokens", "12"]
    compiled = run_titanlite(synthetic_run(tmp_path / "compiled", ["--compile.enable", *samples]), timeout=600)
    assert compiled.returncode == 0, compiled.stderr
    assert "compile model,loss" in compiled.stderr and "eval step: 3" in compiled.stderr
    expected = tensorboard_scalars(tmp_path / "eager" / "tb", "loss/train")
    got = tensorboard_scalars(tmp_path / "compiled" / "tb", "loss/train")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), step


def test_blocks_share_one_graph_and_keep_their_fqns():
    """Compiled over op-level selective AC, as parallelize_decoder orders them, with a document mask."""
    torch._dynamo.reset()
    args = replace(LLAMA3_FLAVORS["debugmodel"], dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    keys = list(model.state_dict())
    tokens = torch.randint(2, 128, (2, 16))
    tokens[0, 5] = tokens[1, 9] = 0  # a bos: two documents per row
    documents = document_ids(tokens, (0, 1))
    expected = model(tokens, document_ids=documents)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(model, Compile(enable=True, components=["model"], backend="eager"))  # tracing only: fast
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = model(tokens, document_ids=documents)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    for grad, expected_grad in zip((p.grad for p in model.parameters()), expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert list(model.state_dict()) == keys


def test_loss_compiles_only_when_asked():
    assert maybe_compile_loss(F.cross_entropy, Compile(enable=False)) is F.cross_entropy
    assert maybe_compile_loss(F.cross_entropy, Compile(enable=True, components=["model"])) is F.cross_entropy
    assert maybe_compile_loss(F.cross_entropy, Compile(enable=True, components=["loss"])) is not F.cross_entropy
    with pytest.raises(UserError, match="compile.components must be one of model, loss; got 'lost'"):
        load_config(["--compile.enable", "--compile.components", "model,lost"])
