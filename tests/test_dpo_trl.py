"""DPO equals TRL's DPOTrainer: at step 1, on the same tiny Qwen3 policy and reference (Qwen3's ChatML template,
thinking blocks and all), the same pairs and beta, in float32, titanlite's loss and its mean chosen and rejected
rewards equal those TRL logs, within 1e-5."""

import json
import shutil

import pytest
import torch
from conftest import ON_CPU, tensorboard_scalars
from qwen3_template import QWEN3_TEMPLATE
from test_dpo import turn

from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.train import main

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

QWEN3 = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.2,
)
BETA = 0.1


# One prompt holds an earlier assistant turn (context, not trained); one completion has a think block of its own.
PAIRS = [
    {
        "prompt": [turn("user", "Say yes.")],
        "chosen": [turn("assistant", "Yes.")],
        "rejected": [turn("assistant", "No.")],
    },
    {
        "prompt": [
            turn("system", "Be kind."),
            turn("user", "Hello?"),
            turn("assistant", "Hi."),
            turn("user", "Help me?"),
        ],
        "chosen": [turn("assistant", "Yes, gladly.")],
        "rejected": [turn("assistant", "No, go away.")],
    },
    {
        "prompt": [turn("user", "Is it true?")],
        "chosen": [turn("assistant", "<think>It is.</think>Yes, it is.")],
        "rejected": [turn("assistant", "No.")],
    },
    {
        "prompt": [turn("user", "Can you?")],
        "chosen": [turn("assistant", "Yes.")],
        "rejected": [turn("assistant", "No, never.")],
    },
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A random Qwen3 policy (seed 0) and reference (seed 1) saved by transformers with Qwen3's template, and the
    pairs."""
    root = tmp_path_factory.mktemp("dpo_trl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer_folder(root / "tokenizer")))
    tokenizer.chat_template = QWEN3_TEMPLATE
    made = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).float().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        made[name] = root / name
    made["pairs"] = root / "pairs.jsonl"
    made["pairs"].write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    shutil.rmtree(root / "tokenizer")
    return made


def trl_step_one(folders, out) -> dict[str, float]:
    """TRL's logged loss and rewards of step 1 (one batch of every pair), in float32 (DPOConfig's bf16 is on by
    default)."""
    from datasets import Dataset

    def load(name):
        return transformers.AutoModelForCausalLM.from_pretrained(
            folders[name], dtype=torch.float32, attn_implementation="eager"
        )

    config = trl.DPOConfig(
        output_dir=str(out),
        beta=BETA,
        bf16=False,
        per_device_train_batch_size=len(PAIRS),
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        gradient_checkpointing=False,
        max_length=None,
        seed=0,
    )
    trainer = trl.DPOTrainer(
        load("policy"),
        ref_model=load("reference"),
        args=config,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=transformers.AutoTokenizer.from_pretrained(str(folders["policy"])),
    )
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logged


def test_step_one_loss_and_rewards_equal_trl(folders, tmp_path):
    argv = [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folders["policy"]),
        "--dpo.reference",
        str(folders["reference"]),
        "--dpo.beta",
        str(BETA),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.dataset_path",
        str(folders["pairs"]),
        "--training.dataset_format",
        "preference",
        "--training.seq_len",
        "96",
        "--training.local_batch_size",
        str(len(PAIRS)),
        "--training.steps",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
    ]
    assert main(argv) == 0
    ours = {
        tag: tensorboard_scalars(tmp_path / "run" / "tb", tag)[1]
        for tag in ("loss/train", "dpo/chosen_reward", "dpo/rejected_reward")
    }
    theirs = trl_step_one(folders, tmp_path / "trl")
    assert abs(ours["dpo/chosen_reward"]) > 1e-3  # a reference other than the policy: the rewards are not all 0
    assert ours["loss/train"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert ours["dpo/chosen_reward"] == pytest.approx(theirs["rewards/chosen"], abs=1e-5)
    assert ours["dpo/rejected_reward"] == pytest.approx(theirs["rewards/rejected"], abs=1e-5)
