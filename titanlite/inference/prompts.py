"""Prompts as generation takes them: the records of a JSON-lines prompts file (generate.prompts_file,
eval.sample_prompts), each {"prompt": text}, {"messages": [...]} or {"token_ids": [...]} (other fields ignored, and
{"prompt": [messages]} read as messages, so a GRPO prompts file generates as it is), checked when the file is
read (one sentence naming the file and line), then rendered as training renders that input: text as the text
pipeline encodes a document (after the tokenizer's bos), messages as apply_chat_template(messages,
add_generation_prompt=True) gives them (nothing added: a bos is there only where the template writes one), token
ids as given."""

import json
from dataclasses import dataclass
from pathlib import Path

from titanlite.data.chat import ChatRenderer, checked_message
from titanlite.errors import UserError

KINDS = ("prompt", "messages", "token_ids")


@dataclass(frozen=True)
class PromptRecord:
    where: str  # where it came from, for error messages: "generate.prompts_file p.jsonl line 3"
    kind: str  # one of KINDS
    value: object  # the text, the messages or the ids, checked


@dataclass(frozen=True)
class Prompt:
    text: str  # the prompt as text (token ids decoded)
    ids: list[int]  # what the model is given
    where: str = ""  # where it came from, for error messages (its record's); "" = its place among the prompts


def checked_record(record, where: str) -> PromptRecord:
    """One line's record, its value of the right type: a string, a list of messages, or a list of token ids >= 0
    (JSON's true and false are not ids)."""
    if not isinstance(record, dict) or len(set(KINDS) & set(record)) != 1:
        raise UserError(f'{where} must hold exactly one of "prompt", "messages" or "token_ids"; fix that line')
    kind = next(k for k in KINDS if k in record)
    value = record[kind]
    if kind == "prompt" and isinstance(value, list):  # GRPO's (and TRL's) conversational prompt: messages
        kind = "messages"
    if kind == "prompt" and not isinstance(value, str):
        raise UserError(
            f'{where}: "prompt" is {json.dumps(value)}, neither a string nor a list of messages; quote the text'
        )
    if kind == "messages":
        if not isinstance(value, list) or not value:
            raise UserError(
                f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects; fix that line'
            )
        value = [checked_message(message, where) for message in value]
    if kind == "token_ids":
        if not isinstance(value, list) or not value or not all(type(i) is int for i in value):
            raise UserError(
                f'{where}: "token_ids" must be a non-empty list of integers (not {json.dumps(value)}); fix that line'
            )
        if min(value) < 0:
            raise UserError(f'{where}: "token_ids" holds {min(value)}; token ids start at 0, fix that line')
    return PromptRecord(where, kind, value)


def read_prompt_lines(path: str, key: str = "generate.prompts_file") -> list[PromptRecord]:
    """The records of the prompts file `path` (the config key `key`), blank lines skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {key} {path} ({error}); point it at a JSON-lines file") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{key} {path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{where} is not JSON ({error.msg}); fix that line") from None
        records.append(checked_record(record, where))
    if not records:
        raise UserError(f'{key} {path} is empty; write one JSON object per line, e.g. {{"prompt": "Once upon a time"}}')
    return records


def render_prompts(records: list[PromptRecord], tokenizer, chat_template: str) -> list[Prompt]:
    """The records as training renders each input (the module's docstring); chat_template: training.chat_template,
    compiled only where a record holds messages."""
    renderer = ChatRenderer(tokenizer, chat_template) if any(r.kind == "messages" for r in records) else None
    return [render_prompt(record, tokenizer, renderer) for record in records]


def render_prompt(record: PromptRecord, tokenizer, renderer: ChatRenderer | None) -> Prompt:
    if record.kind == "token_ids":
        if max(record.value) >= tokenizer.vocab_size:
            raise UserError(
                f'{record.where}: "token_ids" holds {max(record.value)}, outside the tokenizer\'s vocabulary '
                f"of {tokenizer.vocab_size}; use ids from 0 to {tokenizer.vocab_size - 1}"
            )
        return Prompt(tokenizer.decode(record.value), list(record.value), record.where)
    if record.kind == "messages":
        text = renderer.render(record.value, add_generation_prompt=True)
        return Prompt(text, tokenizer.encode(text, bos=False, eos=False), record.where)
    return Prompt(record.value, tokenizer.encode(record.value, bos=True, eos=False), record.where)


def completion_text(new_ids: list[int], tokenizer, stop: list[str] | tuple[str, ...]) -> str:
    """The new tokens as text, cut before the first stop string."""
    text = tokenizer.decode(new_ids)
    cuts = [text.index(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
