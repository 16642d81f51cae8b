"""DPO (training.dataset_format preference, [dpo]): step 1's loss equals the DPO formula computed with transformers on
the policy and reference folders; reference initial gives ln 2; reward accuracy rises on a learnable set; LoRA's
reference (the base, adapters off) equals a separate copy of the base; 2 FSDP ranks and TP 2 equal one process;
a micro-batch is cut to its longest pair rounded up to 64 with the losses of padding to seq_len; the export is a
folder transformers loads; errors are one sentence."""

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import ON_CPU, run_test_script, tensorboard_scalars

from titanlite.config_sections import Model
from titanlite.data import packing
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.train import main

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    vocab_size=640,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def turn(role, content):
    return {"role": role, "content": content}


# Learnable: the chosen answers agree, the rejected ones refuse; one prompt has an earlier assistant turn (context
# only).
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
        "chosen": [turn("assistant", "Yes, it is.")],
        "rejected": [turn("assistant", "No.")],
    },
    {
        "prompt": [turn("user", "Can you?")],
        "chosen": [turn("assistant", "Yes.")],
        "rejected": [turn("assistant", "No, never.")],
    },
]

# Longer than 64 tokens, as is PAIRS[1]: with one pair per micro-batch the widths differ (64, 128).
LONG = {
    "prompt": [turn("user", "Count the words, please: " + " ".join(["one two three"] * 4))],
    "chosen": [turn("assistant", "There are " + " ".join(["many"] * 10) + ".")],
    "rejected": [turn("assistant", "No.")],
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two random Llamas of the same shapes written by transformers (policy seed 0, reference seed 1), one of other
    shapes, the ChatML tokenizer beside each, and the preference pairs."""
    root = tmp_path_factory.mktemp("dpo")
    tokenizer = write_tokenizer_folder(root / "tokenizer")
    made = {}
    for name, seed, config in (
        ("policy", 0, LLAMA),
        ("reference", 1, LLAMA),
        ("other", 2, dict(LLAMA, hidden_size=32)),
    ):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().save_pretrained(root / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, root / name / file)
        made[name] = root / name
    made["pairs"] = write_jsonl(root / "pairs.jsonl", PAIRS)
    return made


def dpo_flags(folders, dump, steps, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folders["policy"]),
        "--job.dump_folder",
        str(dump),
        "--training.dataset_path",
        str(folders["pairs"]),
        "--training.dataset_format",
        "preference",
        "--training.seq_len",
        "96",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.lr",
        "0.005",
        "--lr_scheduler.warmup_steps",
        "0",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        *map(str, extra),
    ]


def completion_logp(model, tokenizer, prompt, completion) -> float:
    """The summed log-probability of what the completion adds to the prompt with its generation prompt (through the
    <|im_end|> and the newline after it, as TRL scores it), by transformers alone."""
    ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    start = len(
        tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    end = len(ids)
    with torch.no_grad():
        logps = F.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    targets = torch.tensor(ids[1:])
    return logps[torch.arange(start - 1, end - 1), targets[start - 1 : end - 1]].sum().item()


def transformers_dpo_loss(policy_folder, reference_folder, beta=0.1) -> float:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(policy_folder))
    policy, reference = (
        transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        for folder in (policy_folder, reference_folder)
    )
    losses = []
    for pair in PAIRS:
        ratio = {
            half: completion_logp(policy, tokenizer, pair["prompt"], pair[half])
            - completion_logp(reference, tokenizer, pair["prompt"], pair[half])
            for half in ("chosen", "rejected")
        }
        losses.append(-F.logsigmoid(torch.tensor(beta * (ratio["chosen"] - ratio["rejected"]))).item())
    return sum(losses) / len(losses)


def test_step_one_equals_transformers_and_reward_accuracy_rises(folders, tmp_path, capsys):
    assert main(dpo_flags(folders, tmp_path, 8, "--dpo.reference", folders["reference"])) == 0
    loss = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert loss[1] == pytest.approx(transformers_dpo_loss(folders["policy"], folders["reference"]), abs=1e-5)
    accuracy, margin = (tensorboard_scalars(tmp_path / "tb", f"dpo/{tag}") for tag in ("reward_accuracy", "margin"))
    chosen, rejected = (tensorboard_scalars(tmp_path / "tb", f"dpo/{half}_reward") for half in ("chosen", "rejected"))
    assert accuracy[8] == 1.0 > accuracy[1] and margin[8] > margin[1] + 1 and loss[8] < loss[1]
    assert margin[8] == pytest.approx(chosen[8] - rejected[8], abs=1e-5)
    assert "DPO reference: a frozen copy of" in capsys.readouterr().err


def test_initial_reference_gives_ln2_and_exports_as_sft(folders, tmp_path):
    assert main(dpo_flags(folders, tmp_path, 3, "--checkpoint.enable", "--checkpoint.last_save_in_hf")) == 0
    loss = tensorboard_scalars(tmp_path / "tb", "loss/train")
    assert loss[1] == pytest.approx(math.log(2), abs=1e-6) and loss[3] < loss[1]
    assert tensorboard_scalars(tmp_path / "tb", "dpo/reward_accuracy")[1] == 0.0  # equal rewards: no pair is ahead yet
    export = tmp_path / "checkpoint" / "step-3-hf"
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= {p.name for p in export.iterdir()}
    tokens = torch.randint(0, 600, (1, 16))
    with torch.no_grad():
        tuned, base = (
            transformers.AutoModelForCausalLM.from_pretrained(f).eval()(tokens).logits
            for f in (export, folders["policy"])
        )
    assert (tuned - base).abs().max() > 1e-3
    # The trained weights as the reference, from the DCP step folder or from the export: the same loss.
    for reference in ("step-3", "step-3-hf"):
        assert (
            main(dpo_flags(folders, tmp_path / reference, 1, "--dpo.reference", tmp_path / "checkpoint" / reference))
            == 0
        )
    dcp, hf = (
        tensorboard_scalars(tmp_path / reference / "tb", "loss/train")[1] for reference in ("step-3", "step-3-hf")
    )
    assert dcp == pytest.approx(hf, abs=1e-6) and abs(dcp - math.log(2)) > 1e-3


def test_lora_reference_is_the_base_with_its_adapters_off(folders, tmp_path):
    """The LoRA base with its adapters switched off (no copy) equals a separate frozen copy of the base folder."""
    lora = ["--lora.rank", "4", "--lora.target_modules", "wq,wv,w2", "--optimizer.lr", "0.02"]
    assert main(dpo_flags(folders, tmp_path / "off", 3, *lora)) == 0
    assert main(dpo_flags(folders, tmp_path / "copy", 3, *lora, "--dpo.reference", folders["policy"])) == 0
    off, copy = (tensorboard_scalars(tmp_path / run / "tb", "loss/train") for run in ("off", "copy"))
    assert off[1] == pytest.approx(math.log(2), abs=1e-6) and off[3] < off[1] - 1e-3
    assert all(off[s] == pytest.approx(copy[s], abs=1e-6) for s in (1, 2, 3))


def test_two_fsdp_ranks_and_tp2_equal_one_process(folders, tmp_path):
    """The same 4 pairs per step: one process, 2 FSDP ranks of 2 pairs each, and 2 TP ranks sharing the 4 (one
    launch)."""
    reference = ["--dpo.reference", folders["reference"]]
    assert main(dpo_flags(folders, tmp_path / "one", 3, *reference)) == 0
    runs = [
        {"argv": dpo_flags(folders, tmp_path / "fsdp", 3, *reference, "--training.local_batch_size", "2")},
        {
            "argv": dpo_flags(
                folders,
                tmp_path / "tp",
                3,
                *reference,
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            )
        },
    ]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    one = tensorboard_scalars(tmp_path / "one" / "tb", "loss/train")
    for layout in ("fsdp", "tp"):
        other = tensorboard_scalars(tmp_path / layout / "tb", "loss/train")
        assert sorted(other) == [1, 2, 3] and all(other[s] == pytest.approx(one[s], abs=1e-5) for s in one), (
            layout,
            other,
            one,
        )
    assert tensorboard_scalars(tmp_path / "fsdp" / "tb", "dpo/margin")[3] == pytest.approx(
        tensorboard_scalars(tmp_path / "one" / "tb", "dpo/margin")[3], abs=1e-5
    )


def test_epochs_count_pairs_and_the_step_line_says_the_epoch(folders, tmp_path, capsys):
    """training.epochs 1.25 of the 4 pairs is 5 pairs; at 2 pairs per step that is 3 steps (rounded up, as for chat
    data); each step line and data/epoch say the passes made: 2, 4 and 6 pairs of 4."""
    flags = dpo_flags(folders, tmp_path, 1, "--training.local_batch_size", "2", "--training.epochs", "1.25")
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert "training.epochs 1.25: 5 pairs at 2 per step, 3 steps (in place of training.steps 1)" in err
    epochs = {int(s): float(e) for s, e in re.findall(r"step: (\d+) .*epoch: ([\d.]+)", err)}
    assert epochs == {1: 0.5, 2: 1.0, 3: 1.5}
    assert tensorboard_scalars(tmp_path / "tb", "data/epoch") == {1: 0.5, 2: 1.0, 3: 1.5}


def test_a_micro_batch_is_cut_to_its_longest_pair_rounded_up_to_64(folders, tmp_path):
    """Each micro-batch's width is its longest sequence (less the last token, which is only a label) rounded up to
    64, at most seq_len, read from the rendered lengths; the rows are those padded to seq_len, cut after their
    padding began. The template's eos (<|im_end|>, the pad id) is in every sequence, so the ids cannot say where one
    ends."""
    data = write_jsonl(tmp_path / "pairs.jsonl", [*PAIRS, LONG])
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folders["policy"])))
    for seq_len, pairs_per_batch in ((256, 1), (256, 2), (96, 1)):
        spec = DataSpec("sample", str(data), seq_len, pairs_per_batch, infinite=False, dataset_format="preference")
        loader = build_dataloader(spec, tokenizer, 0, 1, 0)
        windows = loader.windows
        lengths = [
            max(len(ids) for ids, _ in windows.pairs[g]) for g in windows.order(0)
        ]  # the pairs in epoch 0's order
        widths = []
        for k, (inputs, labels) in enumerate(loader):
            longest = max(lengths[k * pairs_per_batch : (k + 1) * pairs_per_batch]) - 1
            widths.append(inputs.shape[1])
            assert inputs.shape == labels.shape == (2 * pairs_per_batch, min(seq_len, -(-longest // 64) * 64))
            full_inputs, full_labels = (
                torch.cat([windows[g][i] for g in range(k * pairs_per_batch, (k + 1) * pairs_per_batch)])
                for i in (0, 1)
            )
            assert torch.equal(inputs, full_inputs[:, : inputs.shape[1]]) and torch.equal(
                labels, full_labels[:, : inputs.shape[1]]
            )
            # What is cut off is padding: the last real token is only a label, and no label after it trains.
            assert (full_inputs[:, longest + 1 :] == tokenizer.eos_id).all() and (
                full_labels[:, longest:] == -100
            ).all()
            assert (inputs[:, :longest] == tokenizer.eos_id).any(dim=1).all()  # the pad id is a real token of every row
        expected = {(256, 1): [64, 64, 64, 128, 128], (256, 2): [64, 128], (96, 1): [64, 64, 64, 96, 96]}[
            seq_len, pairs_per_batch
        ]
        assert sorted(widths) == expected, (seq_len, pairs_per_batch, widths)


def test_cut_micro_batches_give_the_losses_of_padding_to_seq_len(folders, tmp_path, monkeypatch):
    """4 steps of one pair each (widths 64, 128, 64, 64 of seq_len 192), with a reference model that runs on the same
    cut rows: the losses and rewards equal those of rows padded to seq_len (PAD_MULTIPLE = seq_len) within fp32
    roundoff. A causal forward cannot see padding after a row's tokens, so at equal weights the losses agree (bit for
    bit on the CPU here: steps 1 and 2); the weights' gradients, though, are sums over the batch's positions, and
    the padding's zero terms change how the matmul groups the real ones, so from step 3 they differ by about 4e-7."""
    data = write_jsonl(tmp_path / "pairs.jsonl", [*PAIRS, LONG])
    flags = [
        "--training.dataset_path",
        data,
        "--training.seq_len",
        "192",
        "--training.local_batch_size",
        "1",
        "--dpo.reference",
        folders["reference"],
    ]
    assert main(dpo_flags(folders, tmp_path / "cut", 4, *flags)) == 0
    monkeypatch.setattr(packing, "PAD_MULTIPLE", 192)
    assert main(dpo_flags(folders, tmp_path / "padded", 4, *flags)) == 0
    for tag in ("loss/train", "dpo/chosen_reward", "dpo/rejected_reward"):
        cut, padded = (tensorboard_scalars(tmp_path / run / "tb", tag) for run in ("cut", "padded"))
        assert sorted(cut) == sorted(padded) == [1, 2, 3, 4], tag
        assert all(cut[s] == pytest.approx(padded[s], rel=1e-5, abs=1e-6) for s in cut), (tag, cut, padded)


def test_plain_text_pairs_render_as_one_user_and_one_assistant_turn(folders, tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."}])
    talk = write_jsonl(tmp_path / "talk.jsonl", [PAIRS[0]])
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folders["policy"])))
    batches = []
    for data in (plain, talk):
        spec = DataSpec("sample", str(data), 32, 1, infinite=False, dataset_format="preference")
        batches.append(next(iter(build_dataloader(spec, tokenizer, 0, 1, 0))))
    (inputs, labels), (talk_inputs, talk_labels) = batches
    assert (
        inputs.shape == labels.shape == (2, 32)
        and torch.equal(inputs, talk_inputs)
        and torch.equal(labels, talk_labels)
    )
    trained = [tokenizer.decode(row[row != -100].tolist()) for row in labels]
    assert trained == ["Yes.<|im_end|>\n", "No.<|im_end|>\n"]  # all the completion adds to the prompt, as TRL scores it


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "no_chosen",
            "has no field 'chosen' (its fields are prompt, rejected), which training.dataset_format preference reads",
        ),
        ("other_shapes", "cannot be the reference (the Hugging Face folder"),
        (
            "pipeline",
            "training.dataset_format preference (DPO) with parallelism.pipeline_parallel_degree 2 is not supported yet",
        ),
        ("text", "dpo.beta applies to training.dataset_format preference only"),
        (
            "mixed",
            "record 2 (counting from 1) is plain text where record 1 is message lists; write every record of the file "
            "in one form",
        ),
        (
            "same",
            "every pair's chosen and rejected completions are the same, so the DPO loss is constant with no gradient "
            "and "
            "nothing would train; give each pair a different rejected completion",
        ),
        (
            "train_flag",
            "record 1 (counting from 1) has a chosen message with a train flag, which preference data does not read",
        ),
    ],
)
def test_errors_are_one_sentence_exit_2(folders, tmp_path, capsys, case, message):
    flags = dpo_flags(folders, tmp_path, 1)
    extra = {
        "no_chosen": [
            "--training.dataset_path",
            str(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Hi.", "rejected": "No."}])),
        ],
        "other_shapes": ["--dpo.reference", str(folders["other"])],
        "pipeline": ["--parallelism.pipeline_parallel_degree", "2"],
        "text": [
            "--training.dataset_format",
            "text",
            "--training.dataset",
            "synthetic",
            "--training.dataset_path",
            "",
            "--dpo.beta",
            "0.5",
        ],
        "mixed": [
            "--training.dataset_path",
            str(
                write_jsonl(
                    tmp_path / "mixed.jsonl", [PAIRS[0], {"prompt": "Hi.", "chosen": "Hello.", "rejected": "Go."}]
                )
            ),
        ],
        "same": [
            "--training.dataset_path",
            str(write_jsonl(tmp_path / "same.jsonl", [{**pair, "rejected": pair["chosen"]} for pair in PAIRS])),
        ],
        "train_flag": [
            "--training.dataset_path",
            str(
                write_jsonl(
                    tmp_path / "flag.jsonl", [{**PAIRS[0], "chosen": [{**PAIRS[0]["chosen"][0], "train": False}]}]
                )
            ),
        ],
    }[case]
    assert main([*flags, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
    if case == "other_shapes":
        assert (
            "does not fit llama3/hf: its config.json has hidden_size 32 where this model has 64); point dpo.reference"
            in err
        )


def test_pairs_likely_not_meant_train_with_a_warning(folders, tmp_path, capsys):
    """Some pairs with chosen equal to rejected, or every rejected completion empty, train, and say so before step 1."""
    some_same = write_jsonl(tmp_path / "some_same.jsonl", [{**PAIRS[0], "rejected": PAIRS[0]["chosen"]}, *PAIRS[1:]])
    empty = write_jsonl(tmp_path / "empty.jsonl", [{**pair, "rejected": [turn("assistant", "")]} for pair in PAIRS])
    warnings = {
        some_same: "1 of 4 pairs have the same chosen and rejected completion; they add a constant to the loss and "
        "nothing to its gradient",
        empty: "every rejected completion is empty, so DPO only teaches the model not to end its turn at once; "
        "check that the rejected field holds the answers",
    }
    for data, warning in warnings.items():
        assert main(dpo_flags(folders, tmp_path / data.stem, 1, "--training.dataset_path", data)) == 0
        err = capsys.readouterr().err
        assert warning in err and err.index(warning) < err.index("step: 1 ")


def test_the_planner_counts_the_reference_and_both_sequences_of_a_pair():
    from conftest import DEBUG_CONFIG

    from titanlite.config import load_config
    from titanlite.plan.job import plan_job

    base = ["--job.config_file", DEBUG_CONFIG, "--training.local_batch_size", "2", "--training.seq_len", "256"]
    preference = ["--training.dataset_format", "preference", "--training.dataset_path", "pairs.jsonl"]
    sft = plan_job(load_config([*base, "--training.local_batch_size", "4"])).memory
    full = plan_job(load_config([*base, *preference])).memory
    lora = plan_job(load_config([*base, *preference, "--lora.rank", "8"])).memory
    assert full.reference == full.params and sft.reference == 0  # a copy sharded like the parameters
    assert lora.reference == 0  # the LoRA base with its adapters off: no copy
    assert full.activations == sft.activations  # 2 pairs are 4 sequences
    assert full.peak - sft.peak == full.reference


def test_a_resume_continues_the_losses_of_an_uninterrupted_run(folders, tmp_path):
    """The reference is rebuilt from its source and the pairs continue from the checkpoint's position."""
    flags = [
        "--dpo.reference",
        folders["reference"],
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "false",
    ]
    assert main(dpo_flags(folders, tmp_path / "whole", 4, *flags)) == 0
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    assert main(dpo_flags(folders, tmp_path / "resumed", 4, *flags)) == 0
    whole, resumed = (tensorboard_scalars(tmp_path / run / "tb", "loss/train") for run in ("whole", "resumed"))
    assert sorted(resumed) == [3, 4] and all(resumed[s] == pytest.approx(whole[s], abs=1e-6) for s in (3, 4))


def test_ipo_and_label_smoothing_follow_their_formulas():
    from titanlite.config_sections import DPO
    from titanlite.objectives.dpo import preference_loss

    policy, reference = torch.tensor([-4.0, -9.0, -6.0, -5.0]), torch.tensor([-5.0, -8.0, -6.5, -4.0])
    counts = torch.tensor([2, 3, 4, 5])
    ratio = policy - reference  # chosen, rejected of pair 0, then of pair 1
    loss, stats = preference_loss(policy, reference, counts, DPO(beta=0.5, label_smoothing=0.2))
    margin = 0.5 * torch.stack([ratio[0] - ratio[1], ratio[2] - ratio[3]])
    expected = -(0.8 * F.logsigmoid(margin) + 0.2 * F.logsigmoid(-margin)).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert stats.tolist() == pytest.approx(
        [2, 2, margin.sum().item(), 0.5 * (ratio[0] + ratio[2]).item(), 0.5 * (ratio[1] + ratio[3]).item()]
    )
    averaged = policy / counts - reference / counts  # TRL's IPO: log-probabilities averaged over the completion
    loss, _ = preference_loss(policy, reference, counts, DPO(beta=0.5, loss_type="ipo"))
    differences = torch.stack([averaged[0] - averaged[1], averaged[2] - averaged[3]])
    assert loss.item() == pytest.approx(((differences - 1.0) ** 2).mean().item(), abs=1e-6)
