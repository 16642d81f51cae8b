"""The one checked weight loader (checkpoint/weights.py): a checkpoint of another model family with the same shapes
is refused by name on every path that takes weights as this model's own (generation, a DPO reference), warned about
where a new run deliberately starts from another model's weights, and refused on a resume."""

import json
import shutil

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU

from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.generate import main as generate_main
from titanlite.train import main as train_main

transformers = pytest.importorskip("transformers")

SHAPES = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def mistral_step(tmp_path_factory):
    """A mistral debug model's checkpoint of one step (llama3's debug flavor has the same shapes)."""
    dump = tmp_path_factory.mktemp("mistral")
    assert (
        train_main(
            [
                *ON_CPU,
                "--job.config_file",
                DEBUG_CONFIG,
                "--model.name",
                "mistral",
                "--job.dump_folder",
                str(dump),
                "--training.steps",
                "1",
                "--training.seq_len",
                "64",
                "--checkpoint.enable",
            ]
        )
        == 0
    )
    return dump / "checkpoint" / "step-1"


def test_generation_refuses_another_familys_checkpoint_of_equal_shapes(mistral_step, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n")
    code = generate_main(
        [
            *ON_CPU,
            "--job.config_file",
            DEBUG_CONFIG,
            "--generate.checkpoint",
            str(mistral_step),
            "--generate.prompts_file",
            str(prompts),
            "--generate.max_new_tokens",
            "2",
            "--generate.output",
            str(tmp_path / "out.jsonl"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        f"generate.checkpoint {mistral_step} holds the weights of mistral/debugmodel, another model family than this "
        "job's llama3/debugmodel"
    ) in err


def test_a_new_run_may_start_from_another_familys_weights_with_a_warning(mistral_step, tmp_path, capsys):
    assert (
        train_main(
            [
                *ON_CPU,
                "--job.config_file",
                DEBUG_CONFIG,
                "--job.dump_folder",
                str(tmp_path),
                "--training.steps",
                "1",
                "--training.seq_len",
                "64",
                "--checkpoint.initial_load_path",
                str(mistral_step),
                "--checkpoint.initial_load_model_only",
            ]
        )
        == 0
    )
    assert (
        f"loading the weights of mistral/debugmodel from {mistral_step} into llama3/debugmodel"
        in capsys.readouterr().err
    )


def test_a_dpo_reference_of_another_architecture_with_equal_shapes_is_refused(tmp_path, capsys):
    tokenizer = write_tokenizer_folder(tmp_path / "tokenizer")
    for name, model in (
        ("policy", transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES))),
        ("mistral", transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPES, sliding_window=None))),
    ):
        model.float().save_pretrained(tmp_path / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, tmp_path / name / file)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."}) + "\n")
    torch.manual_seed(0)
    code = train_main(
        [
            *ON_CPU,
            "--model.hf_assets_path",
            str(tmp_path / "policy"),
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--training.dataset_path",
            str(pairs),
            "--training.dataset_format",
            "preference",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "1",
            "--dpo.reference",
            str(tmp_path / "mistral"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        f"dpo.reference {tmp_path / 'mistral'} cannot be the reference (dpo.reference {tmp_path / 'mistral'} holds a "
        "MistralForCausalLM model, not llama3 (LlamaForCausalLM)" in err
    )


def test_a_peer_of_another_model_is_refused_and_one_of_this_model_restores_every_object(world_of_one, tmp_path):
    """Fault tolerance's recovery goes through the checkpoint's objects and the same model check as a resume."""
    from conftest import checkpointed_run, checkpointed_training
    from torchdata.stateful_dataloader import StatefulDataLoader

    from titanlite.checkpoint.manager import CheckpointManager
    from titanlite.config_sections import Checkpoint
    from titanlite.errors import UserError
    from titanlite.fault_tolerance.peer_state import load_peer_state, peer_state

    def objects(seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        training = checkpointed_training(
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            StatefulDataLoader(list(range(4))),
        )
        return CheckpointManager(checkpointed_run(model, Checkpoint(), tmp_path / str(seed)), training).objects

    peer, ours = objects(0), objects(1)
    sent = peer_state(peer)
    sent["train_state"]["step"] = 7
    other = {**sent, "train_state": {**sent["train_state"], "model": "mistral/debugmodel"}}
    with pytest.raises(
        UserError, match="a live peer replica group trains mistral/debugmodel, but this group is linear"
    ):
        load_peer_state(ours, other)
    load_peer_state(ours, sent)
    assert torch.equal(ours["model"].model.weight, peer["model"].model.weight)
    assert ours["train_state"].state.step == 7
