"""Starting a run from a Hugging Face folder (model.hf_assets_path with config.json): the family and every
dimension from config.json, the weights and tokenizer from the folder. A small random Llama (with Llama 3.1's
RoPE scaling) and a Mistral (with a sliding window shorter than the sequence) written by transformers give
titanlite the first-step loss transformers computes on the same batch; every family's config.json round-trips
through its args; bad folders and contradicting [model] keys are one sentence, exit 2."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import DEBUG_CONFIG, ON_CPU, ROOT, logged_losses, run_titanlite, tensorboard_scalars

from titanlite.config import load_config
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.models import list_model_specs
from titanlite.models.hf_folder import matching_flavor
from titanlite.plan.job import plan_job
from titanlite.train import main

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=640,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.2,
)  # weights large enough that a wrong window or RoPE moves the loss by 0.1, not 1e-5
LLAMA = dict(
    SMALL,
    intermediate_size=96,
    rope_parameters={  # 96: no size Meta's formula derives from 64
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
)
MISTRAL = dict(SMALL, intermediate_size=128, sliding_window=16)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


def hf_folder(folder, tokenizer_folder, config_class, **config):
    """A random model written by transformers' save_pretrained (fp32 safetensors), with the tokenizer files beside
    it."""
    torch.manual_seed(0)
    model_class = {"LlamaConfig": transformers.LlamaForCausalLM, "MistralConfig": transformers.MistralForCausalLM}
    model = model_class[config_class.__name__](config_class(**config)).float()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def folder_flags(folder, dump, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(dump),
        "--training.dataset",
        "synthetic",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        *map(str, extra),
    ]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_first_step_loss_equals_transformers_on_the_same_batch(tmp_path, tokenizer_folder, capsys, family):
    """Llama on two FSDP ranks (one window each: the weights loaded straight into the shards), Mistral on one
    process; the global batch is the same two synthetic windows."""
    config_class, config = {
        "llama": (transformers.LlamaConfig, LLAMA),
        "mistral": (transformers.MistralConfig, MISTRAL),
    }[family]
    folder = hf_folder(tmp_path / "model", tokenizer_folder, config_class, **config)
    flags = folder_flags(folder, tmp_path / "run", "--metrics.enable_tensorboard")
    if family == "llama":
        run = run_titanlite([*flags, "--training.local_batch_size", "1"], nproc=2)
        assert run.returncode == 0, run.stderr[-3000:]
        err = run.stderr
        assert "mesh dp_replicate 1 x dp_shard 2" in err
    else:
        assert main(flags) == 0
        err = capsys.readouterr().err
    name = {"llama": "llama3/hf", "mistral": "mistral/hf"}[family]
    assert f"model {name}:" in err and f"loaded the model from the Hugging Face folder {folder}" in err
    ours = tensorboard_scalars(tmp_path / "run" / "tb", "loss/train")[1]

    tokenizer = build_tokenizer(load_config(folder_flags(folder, tmp_path / "run")).model)
    loader = build_dataloader(DataSpec("synthetic", "", 64, 2), tokenizer, 0, 1, 0)
    inputs, labels = next(iter(loader))[:2]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(inputs).logits
    theirs = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    assert ours == pytest.approx(theirs, abs=1e-5)


def test_the_folder_names_the_model_and_the_initial_load(tmp_path, tokenizer_folder):
    folder = hf_folder(tmp_path / "model", tokenizer_folder, transformers.MistralConfig, **MISTRAL)
    cfg = load_config(["--model.hf_assets_path", str(folder)])
    assert (cfg.model.name, cfg.model.flavor) == ("mistral", "hf")
    assert (cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf) == (str(folder), True)
    # Keys that agree with the folder are fine; an explicit initial_load_path is kept.
    cfg = load_config(
        [
            "--model.hf_assets_path",
            str(folder),
            "--model.name",
            "mistral",
            "--model.n_layers",
            "2",
            "--checkpoint.initial_load_path",
            str(tmp_path / "ckpt"),
        ]
    )
    assert cfg.checkpoint.initial_load_path == str(tmp_path / "ckpt") and not cfg.checkpoint.initial_load_in_hf


@pytest.mark.parametrize("spec", list_model_specs(), ids=lambda spec: spec.name)
def test_every_family_config_json_round_trips_through_its_args(spec):
    adapter = spec.hf_adapter
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=640)
    config = json.loads(json.dumps(adapter.hf_config(args)))  # as read back from the file
    back = adapter.args_from_hf_config(config)
    assert adapter.hf_config(back) == adapter.hf_config(args)
    assert adapter.unsupported_setting(config, back) is None
    assert matching_flavor(spec, back) == ("debugmodel", args)


def test_transformers_configs_with_rope_parameters_are_read():
    """transformers 5 writes rope_parameters where older files have rope_theta and rope_scaling."""
    for config_class, config in ((transformers.LlamaConfig, LLAMA), (transformers.MistralConfig, MISTRAL)):
        written = config_class(**config).to_dict()
        spec = {"llama": "llama3", "mistral": "mistral"}[written["model_type"]]
        adapter = next(s for s in list_model_specs() if s.name == spec).hf_adapter
        args = adapter.args_from_hf_config(written)
        assert args.ffn_hidden_dim == config["intermediate_size"] and args.head_dim == 16 and args.n_kv_heads == 2
        assert adapter.unsupported_setting(written, args) is None
    assert args.sliding_window == 16
    llama = next(s for s in list_model_specs() if s.name == "llama3").hf_adapter.args_from_hf_config(
        transformers.LlamaConfig(**LLAMA).to_dict()
    )
    assert llama.rope_theta == 500000.0 and llama.rope_scaling.original_max_seq_len == 32


# meta-llama/Llama-3.1-8B-Instruct's config.json as published (the older rope_theta / rope_scaling spelling).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


# Qwen/Qwen3-30B-A3B's config.json as published: its dense intermediate_size (6144) is unused, every block sparse.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_configs_are_their_flavors(tmp_path):
    from titanlite.models.hf_folder import read_model_folder

    for name, config, expected in (
        ("llama", LLAMA_3_1_8B, ("llama3", "8B")),
        ("qwen", QWEN3_30B_A3B, ("qwen3_moe", "30B-A3B")),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        folder = read_model_folder(tmp_path / name)
        assert (folder.spec.name, folder.flavor) == expected
        assert folder.spec.hf_adapter.config_mismatch(config, folder.args) is None


def test_a_published_llama_3_1_8b_folder_is_llama3_8b_and_its_fine_tuning_config_fits(tmp_path):
    """train_configs/llama3_8b_finetune.toml planned for such a folder (its files only named: the planner reads
    config.json), full and LoRA, fits one 8-GPU H100 node as the README says."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    for name in ("model.safetensors.index.json", "tokenizer.json"):
        (tmp_path / name).touch()
    config = [
        *ON_CPU,
        "--job.config_file",
        str(ROOT / "train_configs" / "llama3_8b_finetune.toml"),
        "--model.hf_assets_path",
        str(tmp_path),
    ]
    cfg = load_config(config)
    assert (cfg.model.name, cfg.model.flavor, cfg.checkpoint.initial_load_path) == ("llama3", "8B", str(tmp_path))
    for lora in ([], ["--lora.rank", "16", "--optimizer.lr", "2e-4"]):
        assert plan_job(load_config([*config, *lora])).memory.share <= 0.90


def error_of(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_folders_and_contradicting_keys_are_one_sentence(tmp_path, tokenizer_folder, capsys):
    folder = hf_folder(tmp_path / "model", tokenizer_folder, transformers.MistralConfig, **MISTRAL)
    flags = folder_flags(folder, tmp_path / "run")
    capsys.readouterr()  # save_pretrained's progress bar
    assert "error: model.name llama3 contradicts model.hf_assets_path" in error_of(
        [*flags, "--job.config_file", DEBUG_CONFIG], capsys
    )
    assert "model.flavor 7B contradicts" in error_of([*flags, "--model.flavor", "7B"], capsys)
    assert "model.n_layers 4 contradicts" in error_of([*flags, "--model.n_layers", "4"], capsys)

    def variant(name, drop=(), **config_changes):
        other = tmp_path / name
        shutil.copytree(folder, other)
        for file in drop:
            (other / file).unlink()
        if config_changes:
            config = json.loads((other / "config.json").read_text()) | config_changes
            (other / "config.json").write_text(json.dumps(config))
        return folder_flags(other, tmp_path / "run")

    err = error_of(variant("bert", architectures=["BertForMaskedLM"], model_type="bert"), capsys)
    assert "holds a BertForMaskedLM model, which titanlite cannot train; supported architectures:" in err
    assert "MistralForCausalLM" in err
    assert "its config.json has hidden_act 'gelu'" in error_of(variant("gelu", hidden_act="gelu"), capsys)
    assert "holds no model.safetensors or model.safetensors.index.json" in error_of(
        variant("no_weights", drop=["model.safetensors"]), capsys
    )
    assert "holds no tokenizer.json or tokenizer.model" in error_of(
        variant("no_tokenizer", drop=["tokenizer.json", "tokenizer_config.json"]), capsys
    )
    assert "holds safetensors weights but no config.json" in error_of(
        variant("no_config", drop=["config.json"]), capsys
    )


def test_the_shipped_fine_tuning_example_learns_from_an_exported_folder(tmp_path, capsys):
    """The commands of train_configs/debug_finetune.toml, shortened: the generated chat data and tokenizer, a debug base
    of 2 layers exported with last_save_in_hf (config.json, weights and the tokenizer files), then full and LoRA
    fine-tuning of
    that folder; the chat loss falls in both, and the fine-tuned export is a folder a run starts from again."""
    from titanlite.examples.chat_example import main as make_example

    make_example(["--output", str(tmp_path / "example"), "--conversations", "40"])
    short = [*ON_CPU, "--training.seq_len", "128", "--training.local_batch_size", "2", "--metrics.log_freq", "1"]
    assert (
        main(
            [
                *short,
                "--job.config_file",
                DEBUG_CONFIG,
                "--job.dump_folder",
                str(tmp_path / "base"),
                "--training.steps",
                "3",
                "--model.n_layers",
                "2",
                "--model.hf_assets_path",
                str(tmp_path / "example" / "tokenizer"),
                "--checkpoint.enable",
                "--checkpoint.last_save_in_hf",
            ]
        )
        == 0
    )
    base = tmp_path / "base" / "checkpoint" / "step-3-hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in base.iterdir()
    }
    capsys.readouterr()
    finetune = [
        *short,
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_finetune.toml"),
        "--model.hf_assets_path",
        str(base),
        "--training.dataset_path",
        str(tmp_path / "example" / "chats.jsonl"),
        "--training.steps",
        "8",
    ]
    for name, extra in (("full", ["--optimizer.lr", "2e-3"]), ("lora", ["--lora.rank", "8", "--optimizer.lr", "4e-3"])):
        assert main([*finetune, "--job.dump_folder", str(tmp_path / name), *extra]) == 0
        err = capsys.readouterr().err
        assert "model llama3/hf:" in err and f"loaded the model from the Hugging Face folder {base}" in err
        losses = logged_losses(err)
        assert losses[7] + losses[8] < 2 * losses[1] - 0.2, (name, losses)
    assert (tmp_path / "lora" / "checkpoint" / "step-8-peft" / "adapter_config.json").is_file()
    # The planner reads the folder as the trainer does (the config's [plan] hardware, one GPU).
    assert plan_job(load_config([*finetune, "--training.seq_len", "256"])).memory.share <= 0.90
    again = load_config(["--model.hf_assets_path", str(tmp_path / "full" / "checkpoint" / "step-8-hf")])
    assert (again.model.name, again.model.flavor, again.checkpoint.initial_load_in_hf) == ("llama3", "hf", True)
