"""Where the trained text of a rendered conversation is: each assistant turn, found in the one rendering of
the whole conversation (templates such as Qwen3's render a turn differently once later turns follow it, so
renderings of prefixes do not line up with the whole).

A template that marks its assistant turns with {% generation %} ... {% endgeneration %} gives the spans
itself, read as transformers' apply_chat_template(return_assistant_tokens_mask=True) reads them. Any other
template: each message's content is found in the rendering, in order; an assistant turn starts after the
generation prompt's header before its content (`<|im_start|>assistant\\n`: the header is what the prompt
gives the model at inference, so a think block the template writes after it is trained) and ends with the
first special token after its content (`<|im_end|>`, `<|eot_id|>`, `</s>`): exactly through the end of turn,
not the newline a template writes after it.
"""

import re

import jinja2
import jinja2.ext
import jinja2.nodes

from titanlite.errors import UserError

MARKED = re.compile(r"{%-?\s*generation\s*-?%}")
THINK_END = "</think>"


class GenerationTracker(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: the block renders as it is, and while a render is tracked
    (track_generation) the character span of each block in the output is recorded."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.pieces: list[str] | None = None  # the output so far, while a render is tracked
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        text = caller()
        if self.pieces is not None:
            start = sum(map(len, self.pieces))
            self.spans.append((start, start + len(text)))
        return text


def track_generation(template: jinja2.Template, variables: dict) -> tuple[str, list[tuple[int, int]]]:
    """(the rendering, the character spans of its generation blocks)."""
    tracker = template.environment.extensions[GenerationTracker.identifier]
    tracker.pieces, tracker.spans = [], []
    try:
        for piece in template.generate(**variables):  # lazily: a block's start is the length rendered before it
            tracker.pieces.append(piece)
        return "".join(tracker.pieces), tracker.spans
    finally:
        tracker.pieces = None


def special_pattern(tokens: list[str]) -> re.Pattern | None:
    """One regex matching any of the tokenizer's special tokens, longest first; None when it has none."""
    return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def content_forms(content: str) -> list[str]:
    """How a template may write a message's content: as is, stripped, or (Qwen3) without its think block."""
    forms = [content, content.strip(), content.split(THINK_END)[-1].strip()]
    return [form for i, form in enumerate(forms) if form and form not in forms[:i]]


def find_content(text: str, content: str, cursor: int) -> tuple[int, int] | None:
    """The character span of a message's content in the rendering at or after cursor, None if not written there."""
    for form in content_forms(content):
        at = text.find(form, cursor)
        if at >= 0:
            return at, at + len(form)
    return None


def header_end(
    text: str, begin: int, end: int, prompt: str, specials: re.Pattern | None, last: bool = True
) -> int | None:
    """Where the longest leading part of the generation prompt found in text[begin:end] ends (the last such
    occurrence, or the first where last is False). A part must reach past the prompt's first special token,
    so that a stray "<" or newline is never taken for a header."""
    first_special = specials.search(prompt) if specials else None
    shortest = first_special.end() if first_special else len(prompt)
    for length in range(len(prompt), max(shortest, 1) - 1, -1):
        part = prompt[:length]
        at = text.rfind(part, begin, end) if last else text.find(part, begin, end)
        if at >= 0:
            return at + length
    return None


def assistant_spans(
    text: str, messages: list[dict], prompt: str, specials: re.Pattern | None, origin: str
) -> list[tuple[int, int]]:
    """The character span of every assistant turn of a rendering made by a template without generation marks."""
    spans, cursor = [], 0
    for number, message in enumerate(messages, start=1):
        content = message.get("content") or ""
        found = find_content(text, content, cursor) if content_forms(content) else None
        if message["role"] != "assistant":
            cursor = found[1] if found else cursor
            continue
        if found:
            start = header_end(text, cursor, found[0], prompt, specials) or found[0]
            content_end = found[1]
        elif not content_forms(content):  # an empty turn (tool calls only): it starts after the next header
            start = content_end = header_end(text, cursor, len(text), prompt, specials, last=False) or cursor
        else:
            raise UserError(
                f"the chat template of {origin} does not write assistant message {number}'s content as the data "
                "has it, so its trained tokens cannot be located; mark the assistant turns in the template with "
                "{% generation %}/{% endgeneration %} or set training.train_on all"
            )
        close = specials.search(text, content_end) if specials else None
        if close is None:
            raise UserError(
                f"the chat template of {origin} writes no special token after assistant message {number}, so the "
                "end of its turn cannot be trained; use a template that closes turns with the end-of-turn token "
                "or mark the turns with {% generation %}/{% endgeneration %}"
            )
        spans.append((start, close.end()))
        cursor = close.end()
    return spans


def literal_contents(text: str, messages: list[dict], specials: re.Pattern | None) -> list[tuple[int, int]]:
    """The spans of the message contents that spell a special token (a user typing "<|im_end|>"): they are
    encoded as text, so only the template's own markers are special tokens. Empty in the usual case."""
    if specials is None or not any(specials.search(message.get("content") or "") for message in messages):
        return []
    spans, cursor = [], 0
    for message in messages:
        found = find_content(text, message.get("content") or "", cursor)
        if found:
            if specials.search(message["content"]):
                spans.append(found)
            cursor = found[1]
    return spans
