"""Fine-tuning data with tools (issue 59.2): a chat record's `tools` (TRL's SFT format, function schemas) reach the chat
template as apply_chat_template's tools argument, and the assistant turns that call tools train as transformers'
assistant mask marks them (a template marked with {% generation %}, and the same template unmarked, whose spans
titanlite finds itself)."""

import json

import pytest
from qwen3_template import QWEN3_TEMPLATE, generation_marked

from titanlite.data.chat import ChatRenderer, Conversations, tokenize_conversation
from titanlite.errors import UserError
from titanlite.examples.chat_example import write_tokenizer_folder

transformers = pytest.importorskip("transformers")


def schema(name: str, parameter: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {parameter: {"type": "string", "description": "its input"}},
                "required": [parameter],
            },
        },
    }


RECORDS = [
    {
        "tools": [schema("calculate", "expression")],
        "messages": [
            {"role": "user", "content": "What is 12 + 7?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 + 7"}}}
                ],
            },
            {"role": "tool", "name": "calculate", "content": "19"},
            {"role": "assistant", "content": "12 + 7 = 19. \\boxed{19}"},
        ],
    },
    {
        "tools": [
            schema("read", "path"),
            schema("calculate", "expression"),
        ],  # another tool: datasets unites the structs
        "messages": [
            {"role": "user", "content": "Read main.py."},
            {
                "role": "assistant",
                "content": "Reading it.",
                "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "main.py"}}}],
            },
            {"role": "tool", "name": "read", "content": "print(1/0)"},
            {"role": "assistant", "content": "It divides by zero."},
        ],
    },
    {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}]},  # no tools
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from titanlite.config_sections import Model
    from titanlite.data.tokenizer import build_tokenizer

    folder = write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"), chat_template=QWEN3_TEMPLATE)
    return build_tokenizer(Model(hf_assets_path=str(folder))), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("marked", [True, False])
def test_tools_render_and_train_as_transformers_marks_them(tokenizers, tmp_path, marked):
    ours, theirs = tokenizers
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    template = tmp_path / "template.jinja"
    template.write_text(generation_marked(QWEN3_TEMPLATE) if marked else QWEN3_TEMPLATE)
    renderer = ChatRenderer(ours, str(template))
    conversations = Conversations(str(data), "chat", "training.dataset_path")
    for record, messages in zip(RECORDS, conversations):
        assert messages.tools == record.get("tools") and list(messages) == record["messages"]  # no nulls added
        ids, trained = tokenize_conversation(renderer, ours, messages, "assistant")
        out = theirs.apply_chat_template(
            record["messages"],
            tools=record.get("tools"),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=generation_marked(QWEN3_TEMPLATE),
        )
        assert ids == out["input_ids"]
        assert trained == [bool(m) for m in out["assistant_masks"]]
        text = theirs.decode(ids)
        for tool in record.get("tools", []):
            assert json.dumps(tool, ensure_ascii=False) in text  # the schema as the template writes it
    first = theirs.decode(tokenize_conversation(renderer, ours, conversations[0], "assistant")[0])
    assert '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 7"}}\n</tool_call>' in first


def test_tools_as_json_text_and_bad_tools(tmp_path):
    data = tmp_path / "text.jsonl"
    record = dict(RECORDS[0], tools=json.dumps(RECORDS[0]["tools"]))
    data.write_text(json.dumps(record) + "\n")
    (messages,) = Conversations(str(data), "chat", "training.dataset_path")
    assert messages.tools == RECORDS[0]["tools"]
    data.write_text(json.dumps(dict(RECORDS[0], tools=[{"type": "function"}])) + "\n")
    with pytest.raises(UserError, match='record 1 \\(counting from 1\\) has "tools" that are not a list of function'):
        Conversations(str(data), "chat", "training.dataset_path")
