"""`python -m titanlite.convert dcp-to-hf` writes what checkpoint.last_save_in_hf writes wherever the run's tokenizer
is known (the run's config.toml above the checkpoint names it): the same files, byte for byte, which transformers'
AutoTokenizer opens and whose generation_config.json stops generate at the end of a turn; where the tokenizer is not
known or cannot be used, it says what it left out and why."""

import shutil

import pytest
import torch
from qwen3_template import QWEN3_TEMPLATE
from test_finetune_qwen3 import CHATS, chat_flags, qwen3_folder  # noqa: F401 (the fixture)

from titanlite.convert import main as convert_main
from titanlite.train import main

transformers = pytest.importorskip("transformers")
STEPS = 25  # enough for the tiny Qwen3 to learn to close its turns


@pytest.fixture(scope="module")
def run(qwen3_folder, tmp_path_factory):  # noqa: F811
    folder, data = qwen3_folder
    dump = tmp_path_factory.mktemp("run")
    assert (
        main(chat_flags(folder, data, dump, STEPS, "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1")) == 0
    )
    return dump


def convert(capsys, *argv) -> tuple[int, str]:
    code = convert_main(["dcp-to-hf", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_convert_writes_what_the_runs_own_export_writes_and_generate_stops_at_the_end_of_turn(run, tmp_path, capsys):
    converted, exported = tmp_path / "hf", run / "checkpoint" / f"step-{STEPS}-hf"
    code, said = convert(capsys, run / "checkpoint" / f"step-{STEPS}", converted)
    assert code == 0 and f"named by {run / 'config.toml'}" in said, said
    assert sorted(p.name for p in converted.iterdir()) == sorted(p.name for p in exported.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= {
        p.name for p in converted.iterdir()
    }
    for path in converted.iterdir():  # the weights too: the same tensors in the same dtype and order
        assert path.read_bytes() == (exported / path.name).read_bytes(), path.name

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    assert tokenizer.chat_template == QWEN3_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(converted).eval()
    stops = model.generation_config.eos_token_id
    assert end_of_turn in (stops if isinstance(stops, list) else [stops])
    prompt = tokenizer.apply_chat_template(
        CHATS[2][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert new[-1] == end_of_turn and len(new) < 40, tokenizer.decode(new)


def test_convert_says_what_it_left_out_where_the_tokenizer_is_not_known_or_gone(run, tmp_path, capsys):
    alone = tmp_path / "alone" / f"step-{STEPS}"  # the checkpoint without the run's folder around it
    shutil.copytree(run / "checkpoint" / f"step-{STEPS}", alone)
    code, said = convert(capsys, alone, tmp_path / "bare")
    assert code == 0 and sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "model.safetensors"]
    assert (
        f"config.json and the weights only: no tokenizer files, chat template, generation_config.json or eos_token_id, "
        f"as the run's tokenizer is not known (no run's config.toml above {alone} names it); add --job.config_file"
    ) in said

    assert (
        convert_main(["dcp-to-hf", str(alone), str(tmp_path / "named"), "--job.config_file", str(run / "config.toml")])
        == 0
    )
    assert (tmp_path / "named" / "generation_config.json").is_file()  # the flags name the run's config

    moved = tmp_path / "moved"  # the run's folder, its tokenizer's folder since deleted
    shutil.copytree(run / "checkpoint" / f"step-{STEPS}", moved / "checkpoint" / f"step-{STEPS}")
    model_folder = str(qwen3_model(run))
    (moved / "config.toml").write_text((run / "config.toml").read_text().replace(model_folder, str(tmp_path / "gone")))
    code, said = convert(capsys, moved / "checkpoint" / f"step-{STEPS}", tmp_path / "partial")
    assert code == 0 and sorted(p.name for p in (tmp_path / "partial").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert (
        f"as the run's tokenizer (named by {moved / 'config.toml'}) cannot be used: " in said
        and str(tmp_path / "gone") in said
    )


def qwen3_model(run) -> str:
    """The model folder the run started from, as its config.toml names it."""
    from titanlite.config import load_config

    return load_config(["--job.config_file", str(run / "config.toml")]).model.hf_assets_path
