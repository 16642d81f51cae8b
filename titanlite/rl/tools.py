"""Tools an agent may call during a rollout, with TRL 1.16's meanings (GRPOTrainer's `tools`).

rl.tools lists specs, `path/to/file.py:function` or `module:function`, loaded as reward functions are: typed Python
functions with Google-style docstrings, described to the chat template by transformers' get_json_schema (as TRL does),
so a function without type hints or docstring is refused at start-up in one sentence.

The model calls a tool as Qwen3's template (and Hermes', and most templates with tools) writes a call:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Each call is answered with a `tool` message: the tool's
result as text (str(result), as TRL), or, where the call is malformed, names no tool, or the tool raises or does not
answer within rl.tool_timeout_seconds, an error as text (TRL's `{'error': ...}`) that the model reads; failures are
counted, the run goes on.

A tool runs on a daemon thread of its own, so that one that hangs can be abandoned after rl.tool_timeout_seconds:
Python cannot stop a thread, so the abandoned call runs on in the background (its result is dropped); a tool that
must be killed should bound its own work. Threads, not processes, because an environment's tools are methods of an
object with state, which a worker process would not share.
"""

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titanlite.errors import UserError
from titanlite.rewards.loading import first_line, load_attribute

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: a name and arguments, or why it is malformed."""

    name: str | None
    arguments: dict | None
    error: str | None = None  # None: well formed

    def as_message(self) -> dict:
        """The call as an assistant message's tool_calls entry (TRL's and the chat templates' form)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_schema(function: Callable, where: str) -> dict:
    """The function's JSON schema as the chat template gets it (transformers' get_json_schema, which TRL uses)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:
        raise UserError(
            f"{where} cannot be described to the model ({first_line(error)}); give every argument a type "
            "hint and the function a Google-style docstring with an Args: section"
        ) from None


def checked_tool(name: str, function, where: str) -> tuple[str, Callable, dict]:
    """(name, the callable, its schema), or one sentence on why it cannot be a tool."""
    if not callable(function) or isinstance(function, type):
        raise UserError(
            f"{where} names a {type(function).__name__}, not a function; name a typed function with a "
            "Google-style docstring"
        )
    return name, function, tool_schema(function, where)


def load_tools(specs: Sequence[str], key: str = "rl.tools") -> list[tuple[str, Callable, dict]]:
    """The tools the specs name, in order, each (name, function, schema); two of one name are refused."""
    tools = []
    for spec in specs:
        name, function = load_attribute(spec, key)
        tools.append(checked_tool(name, function, f"{key} entry {spec!r}"))
    names = [name for name, _, _ in tools]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise UserError(f"{key} names two tools {twice!r}; the model calls tools by name, so list it once")
    return tools


def call_of(body: str) -> ToolCall:
    """A call from the text between <tool_call> and </tool_call>: a JSON object with a name and an object of
    arguments (a JSON string holding that object is read too, as some models write it)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, f"the tool call is not JSON ({error.msg})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, None, 'the tool call has no "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], None, 'the tool call\'s "arguments" is not an object')
    return ToolCall(value["name"], arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every call in a turn's text, in order; a <tool_call> never closed is one malformed call."""
    calls = [call_of(body) for body in CALL.findall(text)]
    if OPEN in CALL.sub("", text):
        calls.append(ToolCall(None, None, "the tool call is not closed by </tool_call>"))
    return calls


def error_text(message: str) -> str:
    """An error as the model reads it: TRL's str({"error": ...})."""
    return str({"error": message})


def run_with_timeout(function: Callable, arguments: dict, seconds: float):
    """function(**arguments) on a daemon thread, its result, or its exception raised here; TimeoutError where it has
    not returned within `seconds` (the thread is abandoned: the module's docstring)."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = function(**arguments)
        except BaseException as error:  # the tool is user code: whatever it raises is answered to the model
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="rl-tool")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the tool did not answer within {seconds:g} seconds")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def answer(call: ToolCall, tools: dict[str, Callable], seconds: float) -> tuple[str, bool]:
    """(the tool message's content, whether the call failed)."""
    if call.error is not None:
        return error_text(call.error), True
    if call.name not in tools:
        return error_text(f"Tool {call.name} not found."), True  # TRL's words
    try:
        return str(run_with_timeout(tools[call.name], call.arguments, seconds)), False
    except Exception as error:
        return error_text(str(error) or type(error).__name__), True
