"""Chat and prompt/completion records rendered with a chat template, tokenized with a mask of the tokens to train.

training.dataset_format "chat": records with `messages`, a list of {role, content} (system/user/assistant/tool,
any number of turns, assistant `tool_calls`) and optionally `tools`, the function schemas the template renders (TRL's
SFT format); "prompt_completion": records with `prompt` and `completion`, rendered as one
user turn and one assistant turn. The template is the Hugging Face folder's (chat_template.jinja, or
tokenizer_config.json's "chat_template") or the file at training.chat_template, rendered as transformers'
apply_chat_template renders it: a sandboxed jinja2 environment with trim_blocks, lstrip_blocks and the
loop-controls extension, its tojson filter, raise_exception and strftime_now, {% generation %} blocks, and
the folder's special tokens (bos_token, eos_token...) as variables.

Each conversation is rendered once; its ids are exactly apply_chat_template's (offsets from the `tokenizers`
library on the whole rendering), with no bos or eos added: a bos is there only where the template writes one.
Which tokens train (training.train_on) is found in that one rendering (chat_spans.py): a token trains when
it overlaps an assistant turn, as transformers' assistant mask marks it. A special token typed inside a
message ("<|im_end|>") is encoded as text.
"""

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titanlite.data.chat_spans import (
    MARKED,
    GenerationTracker,
    assistant_spans,
    literal_contents,
    special_pattern,
    track_generation,
)
from titanlite.data.hf_tokenizer import HFTokenizer
from titanlite.data.local_files import find_data_files, read_errors, read_records, utf8_column_fault, utf8_fault
from titanlite.data.store import TokenStore, concatenate
from titanlite.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_response": "tool", "observation": "tool"}
# What fixes the tokens besides the template (a chat store records its hash): 2 = one rendering, no bos or eos added.
MASK_RULES = "2"
# What a template reads of a message (Qwen3 renders reasoning_content and tool_calls), and the turn's own train flag.
KEPT = ("role", "content", "reasoning_content", "tool_calls", "name", "tool_call_id", "train")
FIELDS = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: json.dumps without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str, origin: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTracker]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(
            f"the chat template of {origin} does not compile (line {error.lineno}: {error.message}); fix the template"
        ) from None


class ChatRenderer:
    """A compiled chat template with the tokenizer's special tokens; renders conversations and their trained spans."""

    def __init__(self, tokenizer, chat_template_path: str):
        if not isinstance(tokenizer, HFTokenizer):
            raise UserError(
                "training.dataset_format chat, prompt_completion and preference need a Hugging Face tokenizer "
                "(tokenizer.json) "
                "that reads the template's special tokens; set model.hf_assets_path to the model's folder"
            )
        if chat_template_path:
            try:
                source, self.origin = (
                    Path(chat_template_path).read_text(),
                    f"training.chat_template {chat_template_path}",
                )
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(
                    f"cannot read training.chat_template {chat_template_path} ({error}); point it at a jinja template "
                    "file"
                ) from None
        elif tokenizer.chat_template:
            source, self.origin = tokenizer.chat_template, str(tokenizer.chat_template_path)
        else:
            raise UserError(
                f"{tokenizer.path.parent} has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template); set training.chat_template to a template file"
            )
        if not isinstance(source, str):  # a list of named templates: transformers uses "default"
            raise UserError(
                f"the chat template of {self.origin} is not one string; set training.chat_template to a template file"
            )
        self.source = source
        self.template = compile_template(source, self.origin)
        self.marked = bool(MARKED.search(source))
        self.template_sha256 = hashlib.sha256(f"{MASK_RULES}\n{source}".encode()).hexdigest()
        self.tokens = dict(tokenizer.special_tokens)
        self.specials = special_pattern(tokenizer.special_texts)
        self.prompt: str | None = None  # the generation prompt, from the first conversation rendered

    def variables(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> dict:
        """What the template reads; tools: the function schemas (TRL's and apply_chat_template's `tools`), or None."""
        return dict(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self.tokens
        )

    def failed(self, error: Exception) -> UserError:
        """A template that raises (raise_exception, or a Python error such as {{ 1/0 }}) as one sentence naming it."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UserError(
            f"the chat template of {self.origin} failed on a conversation ({reason}); fix the template or the data"
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        try:
            return self.template.render(**self.variables(messages, add_generation_prompt, tools))
        except Exception as error:  # the template is user code: any error it raises is the template's
            raise self.failed(error) from None

    def generation_prompt(self, messages: list[dict]) -> str:
        """What add_generation_prompt appends to the conversation before the first assistant turn ("" if not an
        append)."""
        if self.prompt is None:
            first = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
            try:
                before, prompted = (
                    self.render(messages[:first]),
                    self.render(messages[:first], add_generation_prompt=True),
                )
            except (
                UserError
            ):  # the turns before the first answer do not render alone (none, say): learn it from another
                return ""
            self.prompt = prompted[len(before) :] if prompted.startswith(before) else ""
        return self.prompt

    def trained_spans(self, messages: list[dict], train_on: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation rendered once, the character spans of the text to train on)."""
        tools = getattr(messages, "tools", None)  # a Conversation's
        if self.marked and train_on != "all":
            try:
                text, spans = track_generation(self.template, self.variables(messages, False, tools))
            except Exception as error:
                raise self.failed(error) from None
        else:
            text = self.render(messages, tools=tools)
            if train_on == "all":
                return text, [(0, len(text))]
            spans = assistant_spans(text, messages, self.generation_prompt(messages), self.specials, self.origin)
        spans = trained_turns(spans, messages, self.origin)
        return text, spans[-1:] if train_on == "last_assistant" else spans


class Conversation(list):
    """A record's checked messages, and the function schemas the record carries (TRL's SFT `tools`; None: none),
    which the template renders as it renders a tools argument."""

    def __init__(self, messages: list[dict], tools: list[dict] | None = None):
        super().__init__(messages)
        self.tools = tools


def without_nulls(value):
    """A JSON value without the null members of its objects: the datasets library reads a JSON-lines column of
    objects as one struct type, filling each member one record lacks with null (one tool's parameters would gain
    another's as nulls)."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def checked_tools(value, record: str) -> list[dict] | None:
    """A record's `tools`: a list of function schemas ({"type": "function", "function": {"name", ...}}), or that list
    as JSON text (how a table with varied schemas stores it); None or empty: none."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise UserError(
                f'{record} has "tools" text that is not JSON ({error.msg}); write a list of function schemas'
            ) from None
    if not value:
        return None
    value = without_nulls(value)
    if not isinstance(value, list) or not all(
        isinstance(tool, dict) and (tool.get("function") or tool).get("name") for tool in value
    ):
        raise UserError(
            f'{record} has "tools" that are not a list of function schemas '
            '({"type": "function", "function": {"name": ...}}); fix it'
        )
    return value


def sharegpt(turns) -> list:
    """ShareGPT's conversations ({from, value}) as messages ({role, content}); what is not a turn is left for the
    checks."""
    if not isinstance(turns, list):
        return turns
    return [
        {
            **{k: v for k, v in turn.items() if k not in ("from", "value")},
            "role": SHAREGPT_ROLES.get(turn.get("from"), turn.get("from")),
            "content": turn.get("value"),
        }
        if isinstance(turn, dict)
        else turn
        for turn in turns
    ]


def checked_message(message, record: str) -> dict:
    """One message as the template gets it: a known role, text content (an assistant turn of tool calls alone may
    have none), optional reasoning_content, tool_calls and a train flag. `record` names the record it is in."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else message
        raise UserError(f"{record} has a message of unknown role {role!r}; use {', '.join(ROLES)}")
    role, content = message["role"], message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise UserError(f"{record} has a {role} message whose content is not text; fix it")
    if not isinstance(message.get("reasoning_content") or "", str):
        raise UserError(f"{record} has a {role} message whose reasoning_content is not text; fix it")
    if message.get("train") not in (None, True, False):
        raise UserError(f"{record} has a {role} message whose train is {message['train']!r}; use true or false")
    kept = {key: message[key] for key in KEPT if message.get(key) is not None} | {"content": content}
    return kept | ({"tool_calls": without_nulls(kept["tool_calls"])} if "tool_calls" in kept else {})


def conversation(record: dict, dataset_format: str, number: int, where: str) -> list[dict]:
    """The messages of one record (ShareGPT's conversations mapped to messages), checked: roles known, contents
    text, at least one assistant turn to train."""
    if dataset_format == "prompt_completion":
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise UserError(
                f"{where}: record {number} (counting from 1) has a prompt or completion that is not text; fix or "
                "remove it"
            )
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    messages = record["messages"] if "messages" in record else sharegpt(record["conversations"])
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: record {number} (counting from 1) has no list of messages; fix or remove it")
    messages = [checked_message(message, f"{where}: record {number} (counting from 1)") for message in messages]
    if not any(message["role"] == "assistant" and message.get("train") is not False for message in messages):
        raise UserError(
            f"{where}: record {number} (counting from 1) has no assistant turn to train, so nothing of it would be "
            "trained; add one or remove the record"
        )
    return Conversation(messages, checked_tools(record.get("tools"), f"{where}: record {number} (counting from 1)"))


class Conversations(Sequence):
    """The checked conversations of local data files, as message lists (`parse`: a record -> what it holds, checked;
    preference.py's gives a pair of them)."""

    def __init__(self, dataset_path: str, dataset_format: str, key: str, parse=None):
        loader, files = find_data_files(Path(dataset_path), key)
        fields = FIELDS[dataset_format]
        if loader not in ("json", "parquet"):
            raise UserError(
                f"{key} {dataset_path} holds {loader} files; training.dataset_format {dataset_format} reads "
                "jsonl/json/parquet records"
            )
        # pyarrow's json reader keeps bytes that are not UTF-8 and fails only when a record is read: name the line now.
        for path in files if loader == "json" else ():
            if fault := utf8_fault(path):
                raise UserError(f"{key}: {path} {fault}")
        try:
            records = read_records(loader, files)
        except read_errors() as error:
            raise UserError(
                f"{key} {dataset_path} could not be read as {loader} ({str(error).splitlines()[0]}); fix the files"
            ) from None
        if (
            dataset_format == "chat"
            and "messages" not in records.column_names
            and "conversations" in records.column_names
        ):
            fields = ("conversations",)  # ShareGPT
        missing = [field for field in fields if field not in records.column_names]
        if missing:
            raise UserError(
                f"{key} {dataset_path} has no field {missing[0]!r} (its fields are {', '.join(records.column_names)}), "
                f"which training.dataset_format {dataset_format} reads; fix the data or the format"
            )
        if dataset_format == "chat" and "tools" in records.column_names:  # TRL's SFT tools: function schemas per record
            fields = (*fields, "tools")
        self.records = records.select_columns(list(fields))
        if fault := utf8_column_fault(self.records, fields):  # parquet/arrow text is decoded only as a record is read
            raise UserError(f"{key} {dataset_path} {fault}")
        self.messages = [
            (parse or conversation)(record, dataset_format, number, f"{key} {dataset_path}")
            for number, record in enumerate(self.records, start=1)
        ]

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, index: int) -> list[dict]:
        return self.messages[index]


def tokenize_conversation(
    renderer: ChatRenderer, tokenizer: HFTokenizer, messages: list[dict], train_on: str
) -> tuple[list[int], list[bool]]:
    """(the rendered conversation's ids, as apply_chat_template gives them, whether each token is trained)."""
    text, spans = renderer.trained_spans(messages, train_on)
    ids, offsets = tokenizer.encode_with_offsets(text, literal_contents(text, messages, renderer.specials))
    return ids, [any(begin < end_span and end > start_span for start_span, end_span in spans) for begin, end in offsets]


def chat_record(renderer: ChatRenderer, dataset_format: str, train_on: str) -> dict:
    """What fixes a conversation's tokens and loss mask; a chat store keeps it, and a run reading the store must
    match."""
    return {"format": dataset_format, "train_on": train_on, "template_sha256": renderer.template_sha256}


def trained_turns(spans: list[tuple[int, int]], messages: list[dict], origin: str) -> list[tuple[int, int]]:
    """The spans of the assistant turns that train: a message's "train": false leaves its turn out."""
    trains = [message.get("train") is not False for message in messages if message["role"] == "assistant"]
    if all(trains):
        return spans
    if len(spans) != len(trains):
        raise UserError(
            f"the chat template of {origin} marks {len(spans)} generation blocks in a conversation of {len(trains)} "
            "assistant turns, so a message's train flag cannot be applied; mark each turn once or drop the flags"
        )
    return [span for span, train in zip(spans, trains) if train]


def conversation_store(conversations, encode, name: str) -> TokenStore:
    """Conversations tokenized (encode: messages -> ids, trained flags) into an in-memory store with its loss mask."""
    tokens, offsets, mask = concatenate([encode(messages) for messages in conversations], np.int64)
    return TokenStore.from_offsets([tokens], [offsets], name, [mask])
