"""Issue 53: a checkpoint that cannot be verified says so; convert takes the run's own config.toml; checkpoint.enable
false writes no Hugging Face export either. Runs are in-process (titanlite.train.main)."""

import gc
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU
from safetensors.torch import load_file

from titanlite.convert import main as convert_main
from titanlite.train import main as train_main


def flags(folder: Path, steps: int, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(folder),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        *map(str, extra),
    ]


def train(capsys, args: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = train_main(args)
    gc.enable()  # the trainer leaves it off
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    folder = tmp_path_factory.mktemp("history")
    assert train_main(flags(folder, 4)) == 0
    gc.enable()
    return folder


@pytest.fixture
def dump(history, tmp_path) -> Path:
    shutil.copytree(history, tmp_path / "dump")
    return tmp_path / "dump"


def damage(shard: Path) -> None:
    """400 bytes XORed in the middle: DCP loads the file without a word."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 400] = bytes(b ^ 0x5A for b in data[middle : middle + 400])
    shard.write_bytes(bytes(data))


def test_a_checkpoint_without_checksums_is_refused_unless_allowed(capsys, dump):
    step4 = dump / "checkpoint" / "step-4"
    shutil.rmtree(step4 / "checksums")
    damage(step4 / "__0_0.distcp")
    code, out = train(capsys, flags(dump, 6))
    assert code == 2, out
    assert out.strip().splitlines()[-1] == (
        f"error: checkpoint {step4} cannot be verified: it has no checksums folder (lost, or the checkpoint was "
        "written by "
        "another tool or a titanlite before checksums), so damage in its files would load unnoticed; restore that "
        "folder, "
        f"delete {step4} (an earlier checkpoint then loads), or set checkpoint.allow_unverified true to load it "
        "unverified"
    )
    assert "step: 5" not in out
    code, out = train(capsys, flags(dump, 6, "--checkpoint.allow_unverified", "true"))  # asked for: it loads as it is
    assert code == 0, out
    assert f"checkpoint {step4} has no checksums folder: it loads unverified (checkpoint.allow_unverified)" in out
    assert f"resumed from {step4} at step 4" in out


def test_a_save_cut_off_before_its_record_loads_its_files_unverified_and_says_which(capsys, dump):
    step4 = dump / "checkpoint" / "step-4"
    (step4 / "checksums" / "rank0.json").unlink()  # as kill -9 between the .metadata and the record leaves it
    code, out = train(capsys, flags(dump, 5))
    assert code == 0, out
    assert (
        f"checkpoint {step4}: __0_0.distcp and 1 more have no checksum record (the save was cut off before recording "
        "them, or the record was lost), so they load unverified"
    ) in out
    assert f"resumed from {step4} at step 4" in out


def test_checkpoint_enable_false_writes_no_hugging_face_export(capsys, tmp_path):
    code, out = train(
        capsys, flags(tmp_path, 2, "--checkpoint.enable", "false", "--checkpoint.last_save_in_hf", "true")
    )
    assert code == 0, out
    assert not (tmp_path / "checkpoint").exists()
    assert (
        "no Hugging Face export of step 2: checkpoint.enable is false, which turns every save off "
        "(checkpoint.last_save_in_hf too); set checkpoint.enable true to write it"
    ) in out


def test_convert_takes_the_config_toml_of_a_run_started_from_a_hugging_face_folder(capsys, tmp_path):
    """Such a run's config.toml says model.flavor hf (the folder's dimensions are no flavor's): dcp-to-hf with it writes
    what the run's own last_save_in_hf export holds."""
    transformers = pytest.importorskip("transformers")
    from titanlite.examples.chat_example import write_tokenizer_folder

    tokenizer = write_tokenizer_folder(tmp_path / "tokenizer")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=640,
            hidden_size=32,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, tmp_path / "model" / name)
    run = tmp_path / "run"
    code, out = train(
        capsys,
        [
            *ON_CPU,
            "--model.hf_assets_path",
            str(tmp_path / "model"),
            "--job.dump_folder",
            str(run),
            "--training.dataset",
            "synthetic",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--checkpoint.enable",
            "true",
            "--checkpoint.last_save_in_hf",
            "true",
        ],
    )
    assert code == 0 and "model llama3/hf:" in out, out
    converted = tmp_path / "converted"
    assert (
        convert_main(
            [
                "dcp-to-hf",
                str(run / "checkpoint" / "step-2"),
                str(converted),
                "--job.config_file",
                str(run / "config.toml"),
            ]
        )
        == 0
    ), capsys.readouterr().err
    ours, exported = (
        load_file(converted / "model.safetensors"),
        load_file(run / "checkpoint" / "step-2-hf" / "model.safetensors"),
    )
    assert ours.keys() == exported.keys() and all(torch.equal(ours[k], exported[k]) for k in ours)
