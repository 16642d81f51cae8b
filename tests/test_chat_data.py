"""Chat and prompt/completion data: rendered as transformers renders the template, the trained tokens
masked as asked, packed whole, the masked loss by hand, and bad data as one-sentence errors (exit 2)."""

import json
import logging
import re

import pytest
import torch
import transformers
from conftest import logged_losses
from test_hf_tokenizer import write_hf_folder

from titanlite.config_sections import Model
from titanlite.data.chat import ChatRenderer, tokenize_conversation
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.examples import chat_example
from titanlite.loss import IGNORED, cross_entropy_loss
from titanlite.train import main

# Exercises what transformers' environment has: trim_blocks and lstrip_blocks (the indented, line-broken
# tags), loop controls ({% continue %}), raise_exception, namespace, tojson and the special-token variables.
TEMPLATE = """{%- set ns = namespace(system=false) %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
{% endfor %}
{% if not ns.system %}
<|im_start|>system
You help. {{ {'tokens': [pad_token, eos_token]} | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
  {% if message['content'] == '' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is a bee?"}, {"role": "assistant", "content": "An insect that makes honey."}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another? é 🐝"},
        {"role": "assistant", "content": "Green."},
    ],
]


@pytest.fixture
def folder(tmp_path):
    return write_hf_folder(tmp_path / "tok", chat_template=TEMPLATE)


def write_records(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def trained_text(tokenizer, ids, trained):
    return tokenizer.decode([token for token, flag in zip(ids, trained) if flag])


def test_rendering_and_ids_equal_apply_chat_template(folder):
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    renderer = ChatRenderer(tokenizer, "")
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            text = renderer.render(messages, add_generation_prompt=prompt)
            assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        ids, trained = tokenize_conversation(renderer, tokenizer, messages, "assistant")
        expected = theirs(renderer.render(messages), add_special_tokens=False)["input_ids"]
        # exactly the template's tokens: no bos (this folder has none and the template writes none), no eos added
        assert ids == expected and not trained[0] and not trained[-1]


def test_trained_tokens_per_train_on(folder, tmp_path):
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    renderer = ChatRenderer(tokenizer, "")
    messages = CONVERSATIONS[1]
    ids, trained = tokenize_conversation(renderer, tokenizer, messages, "assistant")
    # through the end-of-turn token, not the newline after it
    assert trained_text(tokenizer, ids, trained) == "Blue.<|im_end|>Green.<|im_end|>"
    ids, trained = tokenize_conversation(renderer, tokenizer, messages, "last_assistant")
    assert trained_text(tokenizer, ids, trained) == "Green.<|im_end|>"
    ids, trained = tokenize_conversation(renderer, tokenizer, messages, "all")
    assert trained_text(tokenizer, ids, trained) == renderer.render(messages)
    # a template file instead of the folder's
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    ids, trained = tokenize_conversation(
        ChatRenderer(tokenizer, str(tmp_path / "t.jinja")), tokenizer, messages[:3], "assistant"
    )
    assert trained_text(tokenizer, ids, trained) == "Blue.<|im_end|>"
    # a template that writes no end-of-turn token: refused, as nothing would teach the model to stop
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    with pytest.raises(UserError, match="writes no special token after assistant message 3"):
        tokenize_conversation(ChatRenderer(tokenizer, str(tmp_path / "t.jinja")), tokenizer, messages[:3], "assistant")


def loader(folder, data, seq_len, batch_size=2, **overrides):
    spec = DataSpec(
        **{
            "dataset": "sample",
            "dataset_path": str(data),
            "seq_len": seq_len,
            "batch_size": batch_size,
            "infinite": False,
            "dataset_format": "chat",
            **overrides,
        }
    )
    return build_dataloader(spec, build_tokenizer(Model(hf_assets_path=str(folder))), 0, 1, 0)


def tensors(batch) -> tuple:
    """A chat batch's (inputs, labels, document ids): the ids ride in its extras."""
    return (*batch[:2], batch[2]["document_ids"])


def test_masked_loss_by_hand_on_two_conversations(folder, tmp_path):
    data = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    renderer = ChatRenderer(tokenizer, "")
    encoded = [tokenize_conversation(renderer, tokenizer, m, "assistant") for m in CONVERSATIONS]
    lengths = [len(ids) for ids, _ in encoded]
    seq_len = max(lengths) + 3  # too short for both: one window each, never split, padded with eos
    ((inputs, labels, carried),) = list(loader(folder, data, seq_len))
    documents = carried["document_ids"]
    assert inputs.shape == labels.shape == documents.shape == (2, seq_len) and documents.dtype == torch.int32
    for row in range(2):
        ids, trained = next(e for e in encoded if inputs[row, : len(e[0])].tolist() == e[0])
        assert inputs[row, len(ids) :].eq(tokenizer.eos_id).all()
        assert documents[row].tolist() == [0] * len(ids) + [1] * (
            seq_len - len(ids)
        )  # the padding a document of its own
        expected = [t if f else IGNORED for t, f in zip(ids[1:], trained[1:])] + [IGNORED] * (seq_len + 1 - len(ids))
        assert labels[row].tolist() == expected
    logits = torch.randn(
        2, seq_len, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    total, count = 0.0, 0
    for row in range(2):
        for position in range(seq_len):
            label = int(labels[row, position])
            if label != IGNORED:
                total += float(torch.logsumexp(logits[row, position], 0) - logits[row, position, label])
                count += 1
    assert count == sum(sum(trained[1:]) for _, trained in encoded)
    # the loss is computed in fp32 (the hand sum in float64): within 1e-6 relative
    assert abs(cross_entropy_loss(logits, labels).item() / (total / count) - 1) < 1e-6

    # a window of both holds both though ChatML writes no bos: the window carries where each starts, and the first
    # token of the second is no label (per conversation, as transformers computes each loss, nothing predicts it)
    ((inputs, labels, carried),) = list(loader(folder, data, sum(lengths) - 1, batch_size=1))
    documents = carried["document_ids"]
    first, second = sorted(encoded, key=lambda e: -len(e[0]))  # best fit places the longest first
    assert inputs[0].tolist() == first[0] + second[0][:-1]
    assert documents[0].tolist() == [0] * len(first[0]) + [1] * (len(second[0]) - 1)
    expected = [t if f else IGNORED for t, f in zip(first[0][1:] + second[0], first[1][1:] + [False] + second[1][1:])]
    assert labels[0].tolist() == expected
    # training.packing false: one conversation per window, however long
    assert len(list(loader(folder, data, sum(lengths) + 1, batch_size=1, packing=False))) == 2
    # a template that writes the folder's bos packs as well, each conversation starting with its bos
    bos_folder = write_hf_folder(
        tmp_path / "bos", bos_token="<|begin_of_text|>", chat_template="{{ bos_token }}" + TEMPLATE
    )
    tokenizer = build_tokenizer(Model(hf_assets_path=str(bos_folder)))
    encoded = [tokenize_conversation(ChatRenderer(tokenizer, ""), tokenizer, m, "assistant")[0] for m in CONVERSATIONS]
    assert all(ids[0] == tokenizer.bos_id for ids in encoded)
    ((inputs, labels, carried),) = list(loader(bos_folder, data, len(encoded[0]) + len(encoded[1]), batch_size=1))
    documents = carried["document_ids"]
    assert inputs[0].tolist()[: sum(map(len, encoded))] in ([*encoded[0], *encoded[1]], [*encoded[1], *encoded[0]])


def test_long_conversation_truncated_and_counted(folder, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="titanlite")
    data = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    renderer = ChatRenderer(tokenizer, "")
    encoded = [tokenize_conversation(renderer, tokenizer, m, "assistant") for m in CONVERSATIONS]
    first_trained = [trained.index(True) for _, trained in encoded]
    window = max(first_trained) + 2  # shorter than both, long enough to keep a trained token of each
    windows = list(loader(folder, data, window - 1, batch_size=1))
    assert len(windows) == 2  # each truncated to one window, none split into a second
    for (inputs, labels, _), (ids, _) in zip(sorted(windows, key=lambda w: w[0].tolist()), sorted(encoded)):
        assert inputs[0].tolist() == ids[: window - 1] and (labels != IGNORED).any()
    assert any(
        "2 of 2 conversations are longer than training.seq_len + 1" in record.getMessage() for record in caplog.records
    )
    # a conversation truncated before any trained token is left out, with a line saying so
    ((inputs, labels, _),) = list(loader(folder, data, (min(first_trained) + max(first_trained)) // 2, batch_size=1))
    kept = encoded[first_trained.index(min(first_trained))][0]
    assert inputs[0].tolist() == kept[: len(inputs[0])]
    assert any(
        "1 conversations hold no trained token within one window" in record.getMessage() for record in caplog.records
    )
    # none left at all is one sentence
    with pytest.raises(UserError, match=r"no conversation has a trained token within its first training.seq_len \+ 1"):
        loader(folder, data, min(first_trained) - 1, batch_size=1)


def test_prompt_completion(folder, tmp_path):
    data = write_records(
        tmp_path / "pc.jsonl", [{"prompt": "Say hi.", "completion": "Hi!"}, {"prompt": "Say no.", "completion": "No."}]
    )
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    batches = list(loader(folder, data, 128, batch_size=1, dataset_format="prompt_completion"))
    trained = [tokenizer.decode([t for t in labels[0].tolist() if t != IGNORED]) for _, labels, _ in batches]
    assert trained in (["Hi!<|im_end|>No.<|im_end|>"], ["No.<|im_end|>Hi!<|im_end|>"])  # both packed in one window


def chat_run(tiny_run, folder, data, *flags):
    return tiny_run + [
        "--model.hf_assets_path",
        str(folder),
        "--training.dataset_path",
        str(data),
        "--training.dataset_format",
        "chat",
        *flags,
    ]


def test_trains_on_the_generated_chat_example(tiny_run, tmp_path, capsys):
    chat_example.main(["--output", str(tmp_path / "example"), "--conversations", "40"])
    records = [json.loads(line) for line in (tmp_path / "example" / "chats.jsonl").read_text().splitlines()]
    assert len(records) == 40 and {m["role"] for r in records for m in r["messages"]} == {"system", "user", "assistant"}
    run = chat_run(
        tiny_run,
        tmp_path / "example" / "tokenizer",
        tmp_path / "example" / "chats.jsonl",
        "--training.steps",
        "6",
        "--training.seq_len",
        "256",
    )
    assert main(run) == 0
    losses = logged_losses(capsys.readouterr().err)
    assert len(losses) == 6 and losses[6] < losses[1]


@pytest.mark.parametrize(
    "records, template, message",
    [
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            None,
            "record 1 (counting from 1) has no assistant turn to train, so nothing of it would be trained; add one or "
            "remove the record",
        ),
        (
            [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "robot", "content": "x"}, *CONVERSATIONS[0]]}],
            None,
            "record 2 (counting from 1) has a message of unknown role 'robot'; use system, user, assistant, tool",
        ),
        (
            [{"messages": CONVERSATIONS[1]}],
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
            "failed on a conversation (System role not supported); fix the template or the data",
        ),
        ([{"messages": CONVERSATIONS[0]}], "{% for m in messages %}", "does not compile"),
        (
            [{"messages": CONVERSATIONS[0]}],
            "{{ 1/0 }}",
            "failed on a conversation (division by zero); fix the template or the data",
        ),
        ([{"messages": CONVERSATIONS[0]}], "{{ 'a' + 1 }}", "failed on a conversation (can only concatenate str"),
        (
            [{"messages": CONVERSATIONS[0]}],
            "<|im_start|>Hello<|im_end|>",  # a template that ignores the messages
            "does not write assistant message 2's content as the data has it, so its trained tokens cannot be located",
        ),
    ],
)
def test_bad_data_is_one_sentence_exit_2(tiny_run, folder, tmp_path, capsys, records, template, message):
    data = write_records(tmp_path / "chat.jsonl", records)
    flags = []
    if template:
        (tmp_path / "t.jinja").write_text(template)
        flags = ["--training.chat_template", str(tmp_path / "t.jinja")]
    assert main(chat_run(tiny_run, folder, data, *flags)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_resume_gives_the_windows_an_uninterrupted_run_gives(folder, tmp_path):
    data = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 5])
    whole = loader(folder, data, 100, batch_size=1, infinite=True)
    batches = iter(whole)
    expected = [next(batches) for _ in range(8)]
    first = loader(folder, data, 100, batch_size=1, infinite=True)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    resumed = loader(folder, data, 100, batch_size=1, infinite=True)
    resumed.load_state_dict(first.state_dict())
    batches = iter(resumed)
    for batch in expected[3:]:
        assert all(torch.equal(mine, other) for mine, other in zip(tensors(batch), tensors(next(batches)), strict=True))


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--training.loss_chunk_tokens", "32"],
            "training.dataset_format chat leaves untrained tokens out of the loss, which the chunked loss does not do "
            "yet; set training.loss_chunk_tokens 0",
        ),
        (["--model.hf_assets_path", ""], "need a Hugging Face tokenizer (tokenizer.json)"),
        (
            ["--model.attention_mask", "causal"],
            "packs several conversations into a window, which must not attend to each other; set model.attention_mask "
            "block_causal",
        ),
    ],
)
def test_unsupported_combinations_are_one_sentence_exit_2(tiny_run, folder, tmp_path, capsys, flags, message):
    data = write_records(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    assert main(chat_run(tiny_run, folder, data, *flags)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_a_generation_prompt_that_adds_text_and_a_conversation_that_opens_with_the_answer(folder, tmp_path):
    """R1-style: the generation prompt adds "<think>\\n", which earlier turns do not show; the turn still trains
    from after its header. A conversation whose first message is the assistant's trains too."""
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    r1 = chat_example.CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    (tmp_path / "r1.jinja").write_text(r1)
    renderer = ChatRenderer(tokenizer, str(tmp_path / "r1.jinja"))
    assert renderer.render(CONVERSATIONS[0][:1], add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n"
    )
    ids, trained = tokenize_conversation(renderer, tokenizer, CONVERSATIONS[1], "assistant")
    assert trained_text(tokenizer, ids, trained) == "Blue.<|im_end|>Green.<|im_end|>"
    ids, trained = tokenize_conversation(ChatRenderer(tokenizer, ""), tokenizer, CONVERSATIONS[1][2:3], "assistant")
    assert trained_text(tokenizer, ids, trained) == "Blue.<|im_end|>"


def test_epochs_set_the_steps_and_the_step_line_says_the_epoch(tiny_run, folder, tmp_path, capsys):
    """training.epochs 1.5 trains the windows of one and a half passes (each epoch packs its own order, so counts
    its own windows); every step line says the passes made so far."""
    data = write_records(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS * 5])
    assert main(chat_run(tiny_run, folder, data, "--training.epochs", "1.5")) == 0
    err = capsys.readouterr().err
    per_epoch = int(re.search(r"an epoch is (\d+) windows", err).group(1))
    found = re.search(
        r"training.epochs 1.5: (\d+) windows at 2 per step, (\d+) steps \(in place of training.steps 4\)", err
    )
    windows, steps = map(int, found.groups())
    assert abs(windows - 1.5 * per_epoch) <= 1 and steps == -(-windows // 2) and sorted(logged_losses(err))[-1] == steps
    epochs = {int(s): float(e) for s, e in re.findall(r"step: (\d+) .*epoch: ([\d.]+)", err)}
    assert epochs[1] == pytest.approx(2 / per_epoch, abs=1e-3)
    assert 1.5 - 1e-3 <= epochs[steps] <= 1.5 + 2 / per_epoch + 1e-3
    # The sample corpus is packed per rank as it is read: its epoch length is not known at start.
    assert main([*tiny_run, "--training.epochs", "1"]) == 2
    assert "training.epochs 1 counts passes over data whose epoch length is known at start" in capsys.readouterr().err
