"""Hugging Face format: the RoPE permutation, exact round trips, config.json, the convert CLI."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT
from safetensors import safe_open

from titanlite.checkpoint.hf_io import HFReader, HFWriter, read_hf_tensors
from titanlite.convert import main as convert_main
from titanlite.models import get_model_spec
from titanlite.models.hf import rope_halves_to_pairs, rope_pairs_to_halves
from titanlite.models.llama.model import Transformer, apply_rope, rope_tables

SPEC = get_model_spec("llama3")
ADAPTER = SPEC.hf_adapter
# Small but with grouped-query attention (8 heads, 2 kv heads) and a tied variant below.
ARGS = dataclasses.replace(SPEC.flavors["debugmodel"], dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=100)


def random_model(args=ARGS, seed=0) -> dict[str, torch.Tensor]:
    model = Transformer(args)
    model.init_weights(seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RoPE: rotate_half over split halves, cos/sin repeated over both halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    return x * cos + rotated * sin


def test_permuted_weights_give_hf_rope_the_same_attention_scores():
    torch.manual_seed(0)
    seq, dim, heads, head_dim = 7, 64, 8, 8
    x, wq, wk = torch.randn(seq, dim), torch.randn(heads * head_dim, dim), torch.randn(heads * head_dim, dim)
    cos, sin = rope_tables(head_dim, seq, 10000.0, None)
    ours_q = apply_rope((x @ wq.T).view(1, seq, heads, head_dim), cos, sin)[0]
    ours_k = apply_rope((x @ wk.T).view(1, seq, heads, head_dim), cos, sin)[0]
    hf_q = hf_rope((x @ rope_pairs_to_halves(wq, heads).T).view(seq, heads, head_dim), cos, sin)
    hf_k = hf_rope((x @ rope_pairs_to_halves(wk, heads).T).view(seq, heads, head_dim), cos, sin)
    ours = torch.einsum("qhd,khd->hqk", ours_q, ours_k)
    theirs = torch.einsum("qhd,khd->hqk", hf_q, hf_k)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-4)  # float32; a wrong order is off by O(1)
    assert torch.equal(rope_halves_to_pairs(rope_pairs_to_halves(wq, heads), heads), wq)


def test_permutation_is_transformers_convention():
    # Head of 4 rows [r0, r1, r2, r3] as Meta pairs (r0, r1), (r2, r3) -> HF halves [r0, r2 | r1, r3].
    weight = torch.arange(8.0).view(8, 1)
    assert rope_pairs_to_halves(weight, n_heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_random_model_to_hf_files_and_back_is_exact(tmp_path, tied):
    args = dataclasses.replace(ARGS, tie_embeddings=tied)
    state = random_model(args)
    hf = ADAPTER.to_hf(state, args)
    assert ("lm_head.weight" in hf) != tied
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (16, 64)
    writer = HFWriter(tmp_path, max_shard_bytes=40_000)  # forces several shards
    writer.add(hf)
    writer.finish(ADAPTER.hf_config(args))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf) and len(set(index["weight_map"].values())) > 1
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    back = dict(read_hf_tensors(HFReader(tmp_path), shapes, ADAPTER, args, "llama3/test"))
    assert back.keys() == state.keys()
    for name in state:
        assert torch.equal(back[name], state[name]), name


def test_hf_config_of_llama3_8b():
    config = ADAPTER.hf_config(SPEC.flavors["8B"], "bfloat16")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_scaling" not in ADAPTER.hf_config(get_model_spec("llama2").flavors["7B"])


def convert_in_process(capsys, *args) -> tuple[int, str]:
    code = convert_main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_cli_round_trip_dcp_hf_dcp(tmp_path, capsys):
    """A debugmodel checkpoint -> HF -> DCP again equals the original exactly; bf16 export."""
    args = dataclasses.replace(SPEC.flavors["debugmodel"], vocab_size=300)
    state = random_model(args, seed=3)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)

    out = subprocess.run(  # once as a user runs it
        [
            sys.executable,
            "-m",
            "titanlite.convert",
            "dcp-to-hf",
            str(tmp_path / "dcp"),
            str(tmp_path / "hf"),
            "--model.name",
            "llama3",
            "--model.flavor",
            "debugmodel",
            "--max_shard_mb",
            "2",
            "--checkpoint.allow_unverified",
            "true",
        ],  # written by dcp.save alone: no checksums
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    unverified = (
        f"checkpoint {tmp_path / 'dcp'} has no checksums folder: it loads unverified (checkpoint.allow_unverified)\n"
    )
    assert out.returncode == 0 and out.stderr == unverified, out.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert convert_in_process(capsys, "hf-to-dcp", tmp_path / "hf", tmp_path / "back")[0] == 0
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for name in state:
        assert torch.equal(back[name], state[name]), name

    assert (
        convert_in_process(
            capsys,
            "dcp-to-hf",
            tmp_path / "dcp",
            tmp_path / "bf16",
            "--checkpoint.export_dtype",
            "bfloat16",
            "--checkpoint.allow_unverified",
            "true",
        )[0]
        == 0
    )
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dcp-to-hf", "{tmp}/missing", "{tmp}/hf"], "{tmp}/missing is not a complete DCP checkpoint"),
        (["hf-to-dcp", "{tmp}/missing", "{tmp}/dcp"], "{tmp}/missing is not a Hugging Face model folder"),
        (
            ["hf-to-dcp", "{tmp}/hf", "{tmp}/dcp", "--model.flavor", "1B"],
            "does not fit llama3/1B: its config.json has hidden_size 64",
        ),
        (
            ["hf-to-dcp", "{tmp}/hf", "{tmp}/dcp", "--model.name", "llama2"],
            "does not fit llama2/debugmodel: its config.json has hidden_size",
        ),
        (["to-hf", "{tmp}/a", "{tmp}/b"], "expected a command"),
        (["dcp-to-hf", "{tmp}/a", "{tmp}/b", "--model.flavour", "8B"], "unknown config key model.flavour"),
    ],
)
def test_convert_user_errors_are_one_sentence_and_exit_2(tmp_path, capsys, argv, message):
    writer = HFWriter(tmp_path / "hf")
    writer.add(ADAPTER.to_hf(random_model(), ARGS))
    writer.finish(ADAPTER.hf_config(ARGS))
    code, err = convert_in_process(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.format(tmp=tmp_path) in lines[0], err
