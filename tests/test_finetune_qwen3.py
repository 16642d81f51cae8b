"""Fine-tuning a folder as transformers writes it today: a small random Qwen3 (chat template in chat_template.jinja,
no bos) on multi-turn chats. Step 1's loss equals transformers' over the tokens apply_chat_template's assistant
mask marks; the export stops transformers' greedy generate at <|im_end|>; LoRA with the output layer among its
targets exports a PEFT adapter equal to the merged weights; convert dcp-to-hf exports the run."""

import json
import stat

import pytest
import torch
import torch.nn.functional as F
from conftest import ON_CPU, tensorboard_scalars
from qwen3_template import QWEN3_TEMPLATE, generation_marked
from safetensors import safe_open

from titanlite.convert import main as convert_main
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.train import main

transformers = pytest.importorskip("transformers")

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

CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a bee?"},
        {"role": "assistant", "content": "An insect that makes honey."},
        {"role": "user", "content": "And a wasp?"},
        {"role": "assistant", "content": "An insect that stings.", "reasoning_content": "Wasps sting."},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "One more?"},
        {"role": "assistant", "content": "Red."},
    ],
    [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}],
    [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes, by day."}],
]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A random Qwen3 written by transformers' save_pretrained, and its tokenizer saved by transformers with
    Qwen3's template (so in chat_template.jinja), eos <|im_end|> and no bos."""
    root = tmp_path_factory.mktemp("qwen3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer_folder(root / "tokenizer")))
    tokenizer.chat_template = QWEN3_TEMPLATE
    torch.manual_seed(0)
    folder = root / "model"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file() and tokenizer.bos_token is None
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return folder, data


WINDOWS = 3  # best fit packs the 4 chats into 3 windows of 129 tokens: a batch of 3 is one epoch, each chat once


def chat_flags(folder, data, dump, steps, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(dump),
        "--training.dataset_path",
        str(data),
        "--training.dataset_format",
        "chat",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        str(WINDOWS),
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
        *map(str, extra),
    ]


def transformers_assistant_loss(folder, template: str = QWEN3_TEMPLATE) -> tuple[float, int]:
    """Mean next-token loss of the transformers model over the tokens apply_chat_template marks as the assistant's
    (with a {% generation %}-marked copy of the template), every conversation on its own as apply_chat_template
    gives it: the sum over the trained tokens of all of them, divided by their count."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    total, count = 0.0, 0
    for chat in CHATS:
        out = tokenizer.apply_chat_template(
            chat,
            chat_template=generation_marked(template),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = torch.tensor([out["input_ids"]]), torch.tensor(out["assistant_masks"], dtype=torch.bool)
        assert ids[0, 0] != tokenizer.convert_tokens_to_ids("<|im_end|>")  # nothing before the template's text
        labels = ids[0, 1:].masked_fill(~mask[1:], -100)
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
        count += int(mask[1:].sum())
    return total / count, count


@pytest.fixture(scope="module")
def full_run(qwen3_folder, tmp_path_factory):
    """25 steps of full fine-tuning: enough for the tiny model to learn to close its turns."""
    folder, data = qwen3_folder
    dump = tmp_path_factory.mktemp("full")
    assert main(chat_flags(folder, data, dump, 25, "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1")) == 0
    return dump


def test_qwen3_template_trains_multi_turn_and_the_export_stops_at_the_end_of_turn(qwen3_folder, full_run):
    folder, _ = qwen3_folder
    loss, trained = transformers_assistant_loss(folder)
    assert tensorboard_scalars(full_run / "tb", "loss/train")[1] == pytest.approx(loss, abs=1e-5)
    assert tensorboard_scalars(full_run / "tb", "data/trained_tokens")[1] == trained  # on the step line and TensorBoard

    export = full_run / "checkpoint" / "step-25-hf"
    assert (full_run / "checkpoint" / "step-25" / ".metadata").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((export / "generation_config.json").read_text())
    assert end_of_turn in (
        generation["eos_token_id"] if isinstance(generation["eos_token_id"], list) else [generation["eos_token_id"]]
    )
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == end_of_turn
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o644 for path in export.iterdir())
    assert tokenizer.chat_template == QWEN3_TEMPLATE
    # transformers' greedy generate on the export stops at the end of turn it learnt to write
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    prompt = tokenizer.apply_chat_template(
        CHATS[2][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert new[-1] == end_of_turn and len(new) < 40, tokenizer.decode(new)


def test_generate_finds_the_run_checkpoint_as_training_does_and_equals_its_export(
    qwen3_folder, full_run, tmp_path, capsys
):
    """titanlite.generate from the run's checkpoint folder (checkpoint.enable: the newest step, here the last one),
    from generate.checkpoint, and from the Hugging Face export of the same step: the same greedy tokens, which end
    at the end of turn the run learnt to write."""
    from titanlite.generate import main as generate

    folder, _ = qwen3_folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": CHATS[2][:1]}) + "\n")
    flags = [*ON_CPU, "--generate.prompts_file", str(prompts), "--generate.max_new_tokens", "40"]
    outputs, logs = [], []
    for source in (
        ["--model.hf_assets_path", str(folder), "--checkpoint.enable", "--job.dump_folder", str(full_run)],
        ["--model.hf_assets_path", str(folder), "--generate.checkpoint", str(full_run / "checkpoint" / "step-25")],
        ["--model.hf_assets_path", str(full_run / "checkpoint" / "step-25-hf")],
    ):
        assert generate([*flags, *source]) == 0
        captured = capsys.readouterr()
        outputs.append(json.loads(captured.out)["token_ids"])
        logs.append(captured.err)
    assert "from " + str(full_run / "checkpoint" / "step-25") + "\n" in logs[0], logs[0]
    assert outputs[0] == outputs[1] == outputs[2] and 0 < len(outputs[0]) < 40


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_exports_a_run_started_from_a_folder(full_run, tmp_path, capsys):
    """The checkpoint records the model (llama3/hf is no registered flavor): no flags needed, the same weights
    as the run's own export; flags naming another model are refused; no arguments print the usage, exit 2."""
    step = full_run / "checkpoint" / "step-25"
    assert convert_main(["dcp-to-hf", str(step), str(tmp_path / "hf")]) == 0
    with (
        safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as ours,
        safe_open(str(full_run / "checkpoint" / "step-25-hf" / "model.safetensors"), "pt") as export,
    ):
        assert sorted(ours.keys()) == sorted(export.keys())
        assert all(torch.equal(ours.get_tensor(name), export.get_tensor(name)) for name in ours.keys())
    capsys.readouterr()
    assert (
        convert_main(
            ["dcp-to-hf", str(step), str(tmp_path / "other"), "--model.name", "llama3", "--model.flavor", "debugmodel"]
        )
        == 2
    )
    assert (
        f"{step} was saved from qwen3/hf, but the flags name llama3/debugmodel; drop --model.name"
        in capsys.readouterr().err
    )
    assert convert_main([]) == 2 and capsys.readouterr().err.startswith("usage: python -m titanlite.convert")


def test_lora_on_the_output_layer_exports_a_peft_adapter_equal_to_the_merged_weights(qwen3_folder, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    folder, data = qwen3_folder
    marked = tmp_path / "marked.jinja"  # a template of the run's own, which the exports must carry
    marked.write_text(generation_marked(QWEN3_TEMPLATE))
    assert (
        main(
            chat_flags(
                folder,
                data,
                tmp_path / "lora",
                3,
                "--lora.rank",
                "4",
                "--lora.target_modules",
                "wq,output",
                "--optimizer.lr",
                "1e-2",
                "--training.chat_template",
                marked,
            )
        )
        == 0
    )
    assert "LoRA rank 4 adapters on 3 linear layers: layers.*.attention.wq (2), output (1)" in capsys.readouterr().err
    adapter = tmp_path / "lora" / "checkpoint" / "step-3-peft"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["lm_head", "q_proj"] and config["base_model_name_or_path"] == str(
        folder
    )
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in adapter.iterdir()}
    export = tmp_path / "lora" / "checkpoint" / "step-3-hf"
    assert transformers.AutoTokenizer.from_pretrained(str(export)).chat_template == marked.read_text()
    tokens = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        base_logits = base(tokens).logits
        peft_logits = peft.PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "lora" / "checkpoint" / "step-3-hf"
        ).eval()
        merged_logits = merged(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model
    assert (peft_logits - merged_logits).abs().max() < 1e-5


TOOL_CHAT = [
    {"from": "human", "value": "Read main.py."},
    {
        "from": "gpt",
        "value": None,
        "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "main.py"}}}],
    },
    {"from": "tool", "value": "print(1/0)"},
    {"from": "gpt", "value": "It divides by zero.", "reasoning_content": "Look at the code."},
    {"from": "human", "value": "Thanks."},
    {"from": "gpt", "value": "You are welcome.", "train": False},
]


def test_sharegpt_tool_calls_reasoning_and_untrained_turns_as_transformers_marks_them(qwen3_folder, tmp_path):
    """ShareGPT's conversations/from/value, a tool call and the tool's answer rendered by the template,
    reasoning_content
    kept: the trained tokens are the assistant mask of transformers (marked template); "train": false leaves a turn
    out."""
    from titanlite.config_sections import Model
    from titanlite.data.chat import ChatRenderer, Conversations, tokenize_conversation
    from titanlite.data.tokenizer import build_tokenizer

    folder, _ = qwen3_folder
    data = tmp_path / "sharegpt.jsonl"
    data.write_text(json.dumps({"conversations": TOOL_CHAT}) + "\n")
    (messages,) = Conversations(str(data), "chat", "training.dataset_path")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    ours = build_tokenizer(Model(hf_assets_path=str(folder)))
    ids, trained = tokenize_conversation(ChatRenderer(ours, ""), ours, messages, "assistant")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    plain = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    out = tokenizer.apply_chat_template(
        plain,
        chat_template=generation_marked(QWEN3_TEMPLATE),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert ids == out["input_ids"]
    text = tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "read"' in text and "<tool_response>\nprint(1/0)" in text
    last_turn = len(ids) - ids[::-1].index(tokenizer.convert_tokens_to_ids("<|im_start|>"))  # the untrained last turn
    assert trained == [bool(m) and i < last_turn for i, m in enumerate(out["assistant_masks"])]
    assert any(out["assistant_masks"][last_turn:]) and not any(trained[last_turn:])
