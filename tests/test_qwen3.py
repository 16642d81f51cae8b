"""Qwen3 and Qwen3 MoE: published sizes, and logits equal to transformers' through HF folders both ways."""

import json
from dataclasses import replace

import pytest
import torch

from titanlite.checkpoint.hf_io import load_model_from_hf, save_model_as_hf
from titanlite.models import get_model_args, get_model_spec

# Totals of the published checkpoints (Hugging Face model cards / safetensors metadata); active for MoE.
EXPECTED_PARAMS = {
    ("qwen3", "0.6B"): 596_049_920,
    ("qwen3", "1.7B"): 1_720_574_976,
    ("qwen3", "4B"): 4_022_468_096,
    ("qwen3", "8B"): 8_190_735_360,
    ("qwen3", "14B"): 14_768_307_200,
    ("qwen3", "32B"): 32_762_123_264,
    ("qwen3_moe", "30B-A3B"): 30_532_122_624,
    ("qwen3_moe", "235B-A22B"): 235_093_634_560,
}
EXPECTED_ACTIVE = {("qwen3_moe", "30B-A3B"): 3_353_032_704, ("qwen3_moe", "235B-A22B"): 22_190_763_520}


@pytest.mark.parametrize("family, flavor", sorted(EXPECTED_PARAMS))
def test_param_counts_are_the_published_totals(family, flavor):
    spec = get_model_spec(family)
    with torch.device("meta"):
        model = spec.model_cls(get_model_args(spec, flavor))
    assert model.num_params() == EXPECTED_PARAMS[family, flavor]
    if (family, flavor) in EXPECTED_ACTIVE:
        assert model.num_params(active=True) == EXPECTED_ACTIVE[family, flavor]


def small_args(family: str, **overrides):
    """2 layers, dim 64, 4 query heads of head_dim 32 (not dim / heads = 16), 2 kv heads; 4 experts, top-2."""
    args = replace(
        get_model_args(get_model_spec(family), "debugmodel"),
        vocab_size=50,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        max_seq_len=32,
    )
    if family == "qwen3_moe":
        return replace(args, num_experts=4, top_k=2, moe_intermediate_size=48, **overrides)
    return replace(args, intermediate_size=96, **overrides)


def transformers_model(family: str, args):
    import transformers

    config = get_model_spec(family).hf_adapter.hf_config(args)
    cls = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[family]
    config_cls = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    torch.manual_seed(0)
    model = cls(config_cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}))
    with torch.no_grad():  # norms start at 1: make every one distinct, so a wrong permutation shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model.eval()


def titanlite_model(family: str, args):
    model = get_model_spec(family).model_cls(args)
    model.init_weights(seed=1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model.eval()


FAMILY_CASES = [
    ("qwen3", {}),
    ("qwen3", {"tie_embeddings": True}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False}),
]


@pytest.mark.parametrize("family, overrides", FAMILY_CASES)
def test_transformers_folder_loads_with_equal_logits(tmp_path, family, overrides):
    args = small_args(family, **overrides)
    hf = transformers_model(family, args)
    hf.save_pretrained(tmp_path)
    adapter = get_model_spec(family).hf_adapter
    assert adapter.config_mismatch(json.loads((tmp_path / "config.json").read_text()), args) is None
    model = get_model_spec(family).model_cls(args)
    load_model_from_hf(model.state_dict(), tmp_path, adapter, args, family)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family, overrides", FAMILY_CASES)
def test_titanlite_export_loads_in_transformers_with_equal_logits(tmp_path, family, overrides):
    import transformers

    args = small_args(family, **overrides)
    model = titanlite_model(family, args)
    save_model_as_hf(model.state_dict(), tmp_path, get_model_spec(family).hf_adapter, args, torch.float32, True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == get_model_spec(family).hf_adapter.architectures[0]
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_models_table_lists_qwen3_with_active_params():
    import subprocess
    import sys

    table = subprocess.run(
        [sys.executable, "-m", "titanlite.models"], capture_output=True, text=True, check=True
    ).stdout
    row = next(line for line in table.splitlines() if line.split()[:2] == ["qwen3_moe", "30B-A3B"])
    assert "30,532,122,624" in row and "3,353,032,704" in row
    assert table.splitlines()[0].split()[:4] == ["family", "flavor", "params", "active"]


def test_moe_flops_count_the_active_experts_and_head_dim():
    spec = get_model_spec("qwen3_moe")
    args = get_model_args(spec, "30B-A3B")
    with torch.device("meta"):
        model = spec.model_cls(args)
    active = model.num_params(exclude_embedding=True, active=True)
    assert spec.flops_per_token(model, 4096) == 6 * active + 12 * 48 * 32 * 128 * 4096


@pytest.mark.extended
def test_tp2_equals_one_process(tmp_path):
    """5 steps of each debugmodel under TP2 (q/k norms over the local heads, experts split over ranks)
    give the unsharded model's losses."""
    from conftest import torchrun_json

    results = torchrun_json("tp_families.py", tmp_path, "qwen3,qwen3_moe")
    assert sorted(results) == ["qwen3", "qwen3_moe"]
    for name, pairs in results.items():
        assert len(pairs) == 5
        for tp_loss, one_loss in pairs:
            assert tp_loss == pytest.approx(one_loss, abs=1e-5), name


def test_pp2_equals_one_process(tmp_path):
    """Both debugmodels on 2 pipeline stages (1F1B, 2 micro-batches; Qwen3 MoE's balance loss reaching
    both stages' backward) give the 1-process fp32 losses within 1e-5."""
    from test_pipeline_parallel import PP2, launch, losses, run

    from titanlite.data.prepare import prepare

    prepare("sample", str(tmp_path / "store"))
    flags = {
        family: [
            "--model.name",
            family,
            "--training.global_batch_size",
            "4",
            "--model.moe_aux_loss_coeff",
            "1.0",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ]
        for family in ("qwen3", "qwen3_moe")
    }
    launch(
        [
            run(tmp_path, f"{f}_pp2", [*flags[f], *PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"], 4)
            for f in flags
        ],
        2,
        tmp_path,
        "world2",
    )
    launch([run(tmp_path, f"{f}_one", flags[f], 4) for f in flags], 1, tmp_path, "world1")
    for family in flags:
        one, pp2 = losses(tmp_path, f"{family}_one"), losses(tmp_path, f"{family}_pp2")
        assert sorted(pp2) == sorted(one) == [1, 2, 3, 4]
        for step in one:
            assert pp2[step] == pytest.approx(one[step], abs=1e-5), (family, step)
