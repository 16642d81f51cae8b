"""LoRA ([lora]): adapters on the target layers, the base frozen; adapters-only checkpoints that resume
exactly; FSDP2 equal to one process; exports as merged Hugging Face weights and as a PEFT adapter that
peft puts on the transformers model with the same logits."""

import shutil

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU, logged_losses, run_titanlite, tensorboard_scalars
from test_pipeline_parallel import launch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from titanlite.config_sections import LoRA
from titanlite.errors import UserError
from titanlite.models.lora import LoRALinear, apply_lora
from titanlite.train import main

LORA = [
    "--lora.rank",
    "4",
    "--lora.alpha",
    "8",
    "--lora.target_modules",
    "wq,wk,wv,wo,w1,w2,w3",
    "--optimizer.lr",
    "0.01",
]


def flags(dump, steps=6, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        *LORA,
        *map(str, extra),
    ]


def test_an_adapted_layer_equals_its_merged_weight_and_only_the_adapters_train():
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.ReLU(), nn.Linear(6, 4))
    model[0].weight.data.normal_()
    apply_lora(model, LoRA(rank=2, alpha=4.0, target_modules=["0"]))
    layer = model[0]
    assert isinstance(layer, LoRALinear) and type(model[2]) is nn.Linear
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.lora_a", "0.lora_b"]
    torch.nn.init.normal_(layer.lora_a)
    torch.nn.init.normal_(layer.lora_b)
    x = torch.randn(3, 8)
    merged = layer.weight + layer.scale * layer.lora_b @ layer.lora_a
    assert torch.allclose(layer(x), x @ merged.T, atol=1e-5)


def test_targets_that_match_nothing_are_one_sentence(tmp_path, capsys):
    assert main(flags(tmp_path, 2, "--lora.target_modules", "q_proj")) == 2
    err = capsys.readouterr().err
    assert "error: lora.target_modules q_proj matches no linear layer of the model" in err and "Traceback" not in err
    with pytest.raises(UserError, match="matches no linear layer"):
        apply_lora(nn.Sequential(nn.Linear(2, 2)), LoRA(rank=2, target_modules=["wq"]))


def test_lora_trains_saves_only_the_adapters_and_resumes_exactly(tmp_path, capsys):
    assert (
        main(
            flags(
                tmp_path / "whole",
                6,
                "--checkpoint.enable",
                "--checkpoint.interval",
                "3",
                "--checkpoint.last_save_model_only",
                "false",
            )
        )
        == 0
    )
    whole = logged_losses(capsys.readouterr().err)
    assert whole[6] < whole[1]
    keys = FileSystemReader(str(tmp_path / "whole" / "checkpoint" / "step-3")).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith(("layers.", "tok_embeddings", "norm", "output"))}
    assert "layers.0.attention.wq.lora_a" in model_keys and "layers.0.attention.wq.weight" not in model_keys
    assert all(k.endswith((".lora_a", ".lora_b")) for k in model_keys)
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    assert (
        main(
            flags(
                tmp_path / "resumed",
                6,
                "--checkpoint.enable",
                "--checkpoint.interval",
                "3",
                "--checkpoint.last_save_model_only",
                "false",
            )
        )
        == 0
    )
    resumed = capsys.readouterr().err.split("resumed from")[1]
    assert logged_losses(resumed) == {s: v for s, v in whole.items() if s > 3}
    # Adapters trained on another base are refused in one sentence: the base is known by its weights, not its path.
    assert (
        main(
            flags(
                tmp_path / "seed",
                1,
                "--lora.rank",
                "0",
                "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint",
                "--job.seed",
                "7",
            )
        )
        == 0
    )
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-6")
    capsys.readouterr()
    assert (
        main(
            flags(
                tmp_path / "resumed",
                6,
                "--checkpoint.enable",
                "--checkpoint.interval",
                "3",
                "--checkpoint.initial_load_path",
                str(tmp_path / "seed" / "checkpoint" / "step-0"),
                "--checkpoint.initial_load_model_only",
            )
        )
        == 2
    )
    assert (
        f"holds LoRA adapters trained on another base than this run's ({tmp_path / 'seed' / 'checkpoint' / 'step-0'}: "
        "its weights "
        "differ); set checkpoint.initial_load_path to the base they were trained on (initialised from job.seed)"
    ) in capsys.readouterr().err
    # another rank or other targets name the key, and say the checkpoint holds adapters only
    capsys.readouterr()
    assert main(flags(tmp_path / "resumed", 6, "--checkpoint.enable", "--lora.rank", "8")) == 2
    assert "holds LoRA adapters only, of rank 4, but lora.rank is 8; resume with lora.rank 4" in capsys.readouterr().err
    assert main(flags(tmp_path / "resumed", 6, "--checkpoint.enable", "--lora.target_modules", "wq,wk")) == 2
    err = capsys.readouterr().err
    assert "holds LoRA adapters only, on other layers than this run's lora.target_modules (layers.0." in err
    assert "is adapted in the checkpoint alone); resume with the lora.target_modules it was trained with" in err


@pytest.mark.extended
def test_lora_under_fsdp2_equals_one_process(tmp_path):
    """The same global batch of 4 (synthetic tokens, fp32): one process with 4, or two FSDP ranks with 2 each."""
    same = [
        "--training.dataset",
        "synthetic",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
    ]
    one = run_titanlite(flags(tmp_path / "one", 5, "--training.local_batch_size", "4", *same))
    two = run_titanlite(flags(tmp_path / "two", 5, *same), nproc=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert "mesh dp_replicate 1 x dp_shard 2" in two.stderr
    a, b = (
        tensorboard_scalars(tmp_path / "one" / "tb", "loss/train"),
        tensorboard_scalars(tmp_path / "two" / "tb", "loss/train"),
    )
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    assert all(b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-5) for s in a)
    assert a[5] < a[1]


def test_peft_adapter_on_the_transformers_base_equals_the_merged_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = run_titanlite(
        flags(tmp_path / "base", 2, "--lora.rank", "0", "--checkpoint.enable", "--checkpoint.last_save_in_hf")
    )
    assert base.returncode == 0, base.stderr[-2000:]
    base_hf = tmp_path / "base" / "checkpoint" / "step-2-hf"
    tuned = run_titanlite(
        flags(
            tmp_path / "tuned",
            3,
            "--checkpoint.enable",
            "--checkpoint.last_save_in_hf",
            "--checkpoint.initial_load_path",
            base_hf,
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
        )
    )
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    tokens = torch.randint(0, 2000, (2, 32))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_hf).eval()
        base_logits = plain(tokens).logits
        adapted = peft.PeftModel.from_pretrained(plain, tmp_path / "tuned" / "checkpoint" / "step-3-peft").eval()
        peft_logits = adapted(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "tuned" / "checkpoint" / "step-3-hf"
        ).eval()
        merged_logits = merged(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model
    assert torch.allclose(peft_logits, merged_logits, atol=1e-4)


@pytest.mark.extended
def test_bf16_base_changes_no_result_and_resumes(tmp_path, capsys):
    """lora.base_dtype bfloat16 stores the frozen linears in the bf16 they compute in under
    mixed_precision_param bfloat16: losses equal the float32 base's exactly, on one process and on two
    FSDP ranks, and an adapters-only checkpoint resumes exactly."""
    layers = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    apply_lora(layers, LoRA(rank=2, target_modules=["0"], base_dtype="bfloat16"))
    assert {n: p.dtype for n, p in layers.named_parameters()} == {
        "0.weight": torch.bfloat16,
        "0.bias": torch.bfloat16,
        "0.lora_a": torch.float32,
        "0.lora_b": torch.float32,
        "1.weight": torch.bfloat16,
        "1.bias": torch.bfloat16,
    }
    # bf16 matmuls are slow on a CPU without bf16 instructions: 32-token windows, 2 sequences a step.
    bf16 = [
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.dataset",
        "synthetic",
        "--metrics.enable_tensorboard",
        "--training.seq_len",
        "32",
    ]
    saving = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]

    def run(name, *extra, resume_from=None):
        return {"argv": flags(tmp_path / name, 4, *bf16, *extra), "resume_from": resume_from}

    def losses(name):
        return tensorboard_scalars(tmp_path / name / "tb", "loss/train")

    bf16_base = ["--lora.base_dtype", "bfloat16"]
    launch(
        [
            run("fp32"),
            run("bf16", *bf16_base, *saving),
            run("resumed", *bf16_base, *saving, resume_from=str(tmp_path / "bf16" / "checkpoint" / "step-2")),
        ],
        1,
        tmp_path,
        "one",
    )
    fp32_losses, bf16_losses, resumed_losses = losses("fp32"), losses("bf16"), losses("resumed")
    assert bf16_losses == fp32_losses and sorted(bf16_losses) == [1, 2, 3, 4]
    assert {s: resumed_losses[s] for s in (3, 4)} == {s: bf16_losses[s] for s in (3, 4)}
    one_each = ["--training.local_batch_size", "1"]  # the same 2 sequences a step over two ranks
    launch([run("fsdp_bf16", *one_each, *bf16_base), run("fsdp_fp32", *one_each)], 2, tmp_path, "fsdp")
    assert losses("fsdp_bf16") == losses("fsdp_fp32")
    assert (
        main(flags(tmp_path / "bad", 1, "--lora.base_dtype", "bfloat16", "--training.mixed_precision_param", "float32"))
        == 2
    )
    assert (
        "lora.base_dtype bfloat16 keeps LoRA's frozen weights in the dtype they compute in" in capsys.readouterr().err
    )


def meta_model(family: str, **overrides):
    import dataclasses

    from titanlite.models import get_model_args, get_model_spec

    spec = get_model_spec(family)
    args = dataclasses.replace(get_model_args(spec, "debugmodel"), vocab_size=64, **overrides)
    with torch.device("meta"):
        return spec.model_cls(args)


def test_targets_each_match_and_the_adapted_layers_are_logged(caplog):
    """A typo among targets that match, MoE experts' stacked weights and a tied output are refused in one sentence;
    GPT-2's fused wqkv takes an adapter under the default targets; the log line lists the adapted layers."""
    with pytest.raises(
        UserError, match=r"lora.target_modules w_1 matches no linear layer of the model; name layers it has \(.*w1"
    ):
        apply_lora(meta_model("llama3"), LoRA(rank=2, target_modules=["wq", "w_1"]))
    with pytest.raises(
        UserError, match="lora.target_modules w1,w2 names the MoE experts' stacked weights, which take no LoRA adapter"
    ):
        apply_lora(meta_model("qwen3_moe"), LoRA(rank=2, target_modules=["wq", "w1", "w2"]))
    with pytest.raises(
        UserError,
        match="lora.target_modules output adapts the output layer, which this model ties to its token embeddings",
    ):
        apply_lora(meta_model("qwen3", tie_embeddings=True), LoRA(rank=2, target_modules=["wq", "output"]))
    gpt2 = meta_model("gpt2")
    with caplog.at_level("INFO", logger="titanlite"):
        apply_lora(gpt2, LoRA(rank=2))
    assert isinstance(gpt2.layers["0"].attention.wqkv, LoRALinear) and isinstance(
        gpt2.layers["0"].attention.wo, LoRALinear
    )
    n = len(gpt2.layers)
    assert (
        f"LoRA rank 2 adapters on {2 * n} linear layers: layers.*.attention.wqkv ({n}), layers.*.attention.wo ({n})"
        in caplog.text
    )


def test_gpt2_fused_and_conv1d_adapters_load_in_peft(tmp_path):
    """GPT-2's fused wqkv (adapted for wq) and its Conv1D layers: the PEFT adapter (fan_in_fan_out) on the transformers
    base gives the merged export's logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    common = [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--model.name",
        "gpt2",
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
    ]
    assert main([*common, "--job.dump_folder", str(tmp_path / "base"), "--training.steps", "1"]) == 0
    base = tmp_path / "base" / "checkpoint" / "step-1-hf"
    assert (
        main(
            [
                *common,
                "--job.dump_folder",
                str(tmp_path / "lora"),
                "--training.steps",
                "2",
                "--lora.rank",
                "4",
                "--optimizer.lr",
                "0.01",
                "--lora.target_modules",
                "wq,wo,w1,w2",
                "--checkpoint.initial_load_path",
                str(base),
                "--checkpoint.initial_load_in_hf",
                "--checkpoint.initial_load_model_only",
            ]
        )
        == 0
    )
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        base_logits = plain(tokens).logits
        peft_logits = (
            peft.PeftModel.from_pretrained(plain, tmp_path / "lora" / "checkpoint" / "step-2-peft")
            .eval()(tokens)
            .logits
        )
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "lora" / "checkpoint" / "step-2-hf"
        ).eval()
        merged_logits = merged(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3
    assert (peft_logits - merged_logits).abs().max() < 1e-5


def test_adapters_start_the_same_with_or_without_activation_checkpointing(world_of_one):
    """Each A is drawn from its state-dict name, AC's wrapper left out: turning AC on changes no starting value."""
    from titanlite.build import build_run
    from titanlite.config import load_config
    from titanlite.models.lora import adapted_layers
    from titanlite.parallel.dist import DistInfo

    starts = []
    for mode in ("none", "full"):
        cfg = load_config([*ON_CPU, "--job.config_file", DEBUG_CONFIG, *LORA, "--activation_checkpoint.mode", mode])
        run = build_run(cfg, DistInfo(0, 1, torch.device("cpu"), ""))
        starts.append({name: layer.lora_a.detach().clone() for name, layer in adapted_layers(run.model).items()})
    assert starts[0].keys() == starts[1].keys() and len(starts[0]) == 7 * 6
    assert all(torch.equal(starts[0][name], starts[1][name]) for name in starts[0])


@pytest.mark.parametrize("family", ["mixtral", "llama3", "llama3_tied"])
def test_flops_per_token_under_lora_count_what_a_token_uses(family):
    """By hand, for LoRA on wq,wv (seq 64): forward 2 x A, input gradients 2 x A, weight gradients 2 x (A - F), plus
    attention 12 x layers x heads x head_dim x seq; A = the active non-embedding parameters (a token's top_k of E
    routed experts), F = the frozen matrices a token uses, the top_k experts' share of the stacked experts, not all
    E (all 16 made this count negative). The norms are frozen but no matmuls: they count 6 like every
    parameter, as the family formula counts them. Llama's count is the one before MoE's share (all frozen matrices).
    Tied embeddings change nothing: the one matrix is the frozen output projection (its embedding side is a lookup)."""
    from titanlite.build import model_flops_per_token
    from titanlite.models import get_model_spec
    from titanlite.models.construct import meta_model
    from titanlite.models.llama.args import ModelArgs
    from titanlite.models.mixtral.args import MixtralArgs

    shapes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, intermediate_size=96)
    args = (
        MixtralArgs(**shapes, num_experts=16, top_k=2)
        if family == "mixtral"
        else ModelArgs(**shapes, tie_embeddings=family == "llama3_tied")
    )
    spec, (d, layers, kv, hidden, seq, rank) = get_model_spec(family.removesuffix("_tied")), (64, 2, 2 * 16, 96, 64, 4)
    model = meta_model(spec, args, "float32", LoRA(rank=rank, target_modules=["wq", "wv"]))
    experts, gate = (2 * 3 * hidden * d, 16 * d) if family == "mixtral" else (3 * hidden * d, 0)
    frozen = layers * (d * d + d * kv + d * kv + d * d + gate + experts) + 128 * d  # wq wk wv wo, router, MLP; output
    adapters = layers * (rank * (d + d) + rank * (d + kv))  # wq's A and B, wv's
    norms = (2 * layers + 1) * d
    active = frozen + adapters + norms
    hand = 2 * active + 2 * active + 2 * (active - frozen) + 12 * layers * 4 * 16 * seq
    assert model_flops_per_token(spec, model, seq) == hand > 0
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapters
