"""Chat and prompt/completion records rendered with a chat template, tokenized with a mask of the tokens to train.

training.dataset_format "chat": records with `messages`, a list of {role, content} (system/user/assistant,
any number of turns); "prompt_completion": records with `prompt` and `completion`, rendered as one
user turn and one assistant turn. The template is the Hugging Face folder's (tokenizer_config.json's
"chat_template") or the file at training.chat_template, rendered as transformers' apply_chat_template
renders it: a sandboxed jinja2 environment with trim_blocks, lstrip_blocks and the loop-controls
extension, its tojson filter, raise_exception and strftime_now, and the folder's special tokens
(bos_token, eos_token...) as variables.

Which tokens train (training.train_on): an assistant turn is the text between the conversation rendered
up to the turn before it with the generation prompt, and rendered up to the turn itself, so the turn's
own end marker (<|im_end|>, <|eot_id|>) is trained and the header before it is not. A token trains
when it starts inside such a span (offsets from the `tokenizers` library, on the whole rendered text,
so the ids are exactly apply_chat_template's).
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

from titanlite.data.hf_tokenizer import HFTokenizer
from titanlite.data.local_files import find_data_files, read_errors, read_records
from titanlite.data.store import TokenStore, concatenate
from titanlite.errors import UserError

ROLES = ("system", "user", "assistant")
FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion")}


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: json.dumps without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str, origin: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(f"the chat template of {origin} does not compile (line {error.lineno}: {error.message}); fix the template") from None


class ChatRenderer:
    """A compiled chat template with the tokenizer's special tokens; renders conversations and their trained spans."""

    def __init__(self, tokenizer, chat_template_path: str):
        if not isinstance(tokenizer, HFTokenizer):
            raise UserError("training.dataset_format chat and prompt_completion need a Hugging Face tokenizer (tokenizer.json) "
                            "that reads the template's special tokens; set model.hf_assets_path to the model's folder")
        if chat_template_path:
            try:
                source, self.origin = Path(chat_template_path).read_text(), f"training.chat_template {chat_template_path}"
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(f"cannot read training.chat_template {chat_template_path} ({error}); point it at a jinja template file") from None
        elif tokenizer.chat_template:
            source, self.origin = tokenizer.chat_template, str(tokenizer.path.parent / "tokenizer_config.json")
        else:
            raise UserError(f"{tokenizer.path.parent / 'tokenizer_config.json'} has no chat_template; set training.chat_template to a template file")
        if not isinstance(source, str):  # a list of named templates: transformers uses "default"
            raise UserError(f"the chat template of {self.origin} is not one string; set training.chat_template to a template file")
        self.template = compile_template(source, self.origin)
        self.template_sha256 = hashlib.sha256(source.encode()).hexdigest()
        self.tokens = dict(tokenizer.special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.tokens)
        except jinja2.TemplateError as error:
            raise UserError(f"the chat template of {self.origin} failed on a conversation ({error}); fix the template or the data") from None

    def trained_spans(self, messages: list[dict], train_on: str) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans of the text to train on)."""
        text = self.render(messages)
        if train_on == "all":
            return text, [(0, len(text))]
        turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if train_on == "last_assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before, through = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise UserError(f"the chat template of {self.origin} renders the first turns of a conversation differently from the whole, "
                                "so the assistant turns cannot be located; set training.train_on all or use another template")
            spans.append((len(before), len(through)))
        return text, spans


def conversation(record: dict, dataset_format: str, number: int, where: str) -> list[dict]:
    """The messages of one record, checked: roles known, contents text, at least one assistant turn."""
    if dataset_format == "prompt_completion":
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise UserError(f"{where}: record {number} (counting from 1) has a prompt or completion that is not text; fix or remove it")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: record {number} (counting from 1) has no list of messages; fix or remove it")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise UserError(f"{where}: record {number} (counting from 1) has a message of unknown role {role!r}; "
                            f"use {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: record {number} (counting from 1) has a {message['role']} message whose content is not text; fix it")
    if not any(message["role"] == "assistant" for message in messages):
        raise UserError(f"{where}: record {number} (counting from 1) has no assistant turn, so nothing of it would be trained; "
                        "add one or remove the record")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class Conversations(Sequence):
    """The checked conversations of local data files, as message lists."""

    def __init__(self, dataset_path: str, dataset_format: str, key: str):
        loader, files = find_data_files(Path(dataset_path), key)
        fields = FIELDS[dataset_format]
        if loader not in ("json", "parquet"):
            raise UserError(f"{key} {dataset_path} holds {loader} files; training.dataset_format {dataset_format} reads jsonl/json/parquet records")
        try:
            records = read_records(loader, files)
        except read_errors() as error:
            raise UserError(f"{key} {dataset_path} could not be read as {loader} ({str(error).splitlines()[0]}); fix the files") from None
        missing = [field for field in fields if field not in records.column_names]
        if missing:
            raise UserError(f"{key} {dataset_path} has no field {missing[0]!r} (its fields are {', '.join(records.column_names)}), "
                            f"which training.dataset_format {dataset_format} reads; fix the data or the format")
        self.records = records.select_columns(list(fields))
        self.messages = [conversation(record, dataset_format, number, f"{key} {dataset_path}")
                         for number, record in enumerate(self.records, start=1)]

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, index: int) -> list[dict]:
        return self.messages[index]


def tokenize_conversation(renderer: ChatRenderer, tokenizer: HFTokenizer, messages: list[dict],
                          train_on: str) -> tuple[list[int], list[bool]]:
    """(bos + the rendered conversation's ids + eos, whether each token is trained). bos and eos are added
    only where the template did not write them, and are never trained: they delimit the documents."""
    text, spans = renderer.trained_spans(messages, train_on)
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
    if not ids or ids[0] != tokenizer.bos_id:
        ids, trained = [tokenizer.bos_id] + ids, [False] + trained
    if ids[-1] != tokenizer.eos_id:
        ids, trained = ids + [tokenizer.eos_id], trained + [False]
    return ids, trained


def chat_record(renderer: ChatRenderer, dataset_format: str, train_on: str) -> dict:
    """What fixes a conversation's tokens and loss mask; a chat store keeps it, and a run reading the store must match."""
    return {"format": dataset_format, "train_on": train_on, "template_sha256": renderer.template_sha256}


def conversation_store(conversations, encode, name: str) -> TokenStore:
    """Conversations tokenized (encode: messages -> ids, trained flags) into an in-memory store with its loss mask."""
    tokens, offsets, mask = concatenate([encode(messages) for messages in conversations], np.int64)
    return TokenStore.from_offsets([tokens], [offsets], name, [mask])
