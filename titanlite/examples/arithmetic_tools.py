"""The arithmetic task of titanlite.examples.arithmetic answered with a calculator tool, for the agent example
(docs/agents.md, scripts/agent_debug.sh).

    python -m titanlite.examples.arithmetic_tools --out DIR [--count N] [--prompts M] [--seed S]

writes DIR/sft.jsonl, N chat records in TRL's SFT format with tools (training.dataset_format chat): the calculator's
schema in `tools`, and a conversation that calls it, reads its result and answers,

    user: What is 12 + 7?
    assistant: <tool_call>{"name": "calculate", "arguments": {"expression": "12 + 7"}}</tool_call>
    tool: 19
    assistant: \\boxed{19}

(the answer is the tool's result copied: a model of the debug size learns to copy numbers far sooner than to add
them), DIR/prompts.jsonl, M GRPO prompts with their `answer` (the arithmetic task's), and DIR/tool_template.jinja, a
short ChatML template that renders tools, tool calls and tool results (training.chat_template; the chat example's
tokenizer has none that does). `Calculator` is the environment GRPO gives the model (rl.environment
titanlite.examples.arithmetic_tools:Calculator): its one tool evaluates sums and differences.
"""

import argparse
import re
import sys
from pathlib import Path

from titanlite.errors import UserError, exit_code
from titanlite.examples.arithmetic import result, task, write_jsonl

# ChatML with tools, short so that the debug model sees many conversations a second: a system turn naming each tool
# and its parameters, calls as <tool_call> JSON in the assistant's turn (as Qwen3 writes them), results in a turn of
# the tool's own role.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{%- set f = tool.function %}"
    "{{- ' ' + f.name + '(' + f.parameters.properties | join(', ') + ')' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}{%- set call = call.function or call %}"
    "{{- '<tool_call>{\"name\": \"' + call.name + '\", \"arguments\": ' + call.arguments | tojson + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
EXPRESSION = re.compile(r"\s*(-?\d+)\s*([+\-])\s*(-?\d+)\s*")


class Calculator:
    """The agent example's environment (TRL's environment_factory interface): no state, one tool."""

    def reset(self, **record) -> None:
        return None

    def calculate(self, expression: str) -> str:
        """Evaluates a + b or a - b.

        Args:
            expression: the sum or difference
        """
        match = EXPRESSION.fullmatch(expression)
        if match is None:
            raise ValueError(f"cannot evaluate {expression!r}; write a + b or a - b")
        a, operator, b = match.groups()
        return str(result(int(a), operator, int(b)))


def calculator_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(Calculator().calculate)


def tool_record(question: dict, schema: dict) -> dict:
    """A worked arithmetic answer (arithmetic.py's sft_record) as a conversation that calls the calculator."""
    user, answer = question["messages"]
    expression = answer["content"].split(" = ")[0]
    value = answer["content"].split(" = ")[1].split(".")[0]
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {
        "tools": [schema],
        "messages": [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": value},
            {"role": "assistant", "content": f"\\boxed{{{value}}}"},  # the result copied, nothing else to learn
        ],
    }


def write_task(out: str, count: int, prompts: int, seed: int) -> None:
    sft, prompt_records = task(count, prompts, seed)
    schema = calculator_schema()
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "sft.jsonl", [tool_record(record, schema) for record in sft])
        write_jsonl(folder / "prompts.jsonl", prompt_records)
        (folder / "tool_template.jinja").write_text(TOOL_TEMPLATE)
    except OSError as error:
        raise UserError(
            f"cannot write the task to --out {out} ({error.strerror or error}); choose a folder you can write to"
        ) from None
    print(
        f"wrote {len(sft)} tool-calling chat records to {folder / 'sft.jsonl'}, {len(prompt_records)} prompts to "
        f"{folder / 'prompts.jsonl'} and the template {folder / 'tool_template.jinja'}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.examples.arithmetic_tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="the folder to write sft.jsonl, prompts.jsonl and the template to")
    parser.add_argument("--count", type=int, default=2000, help="tool-calling chat records in sft.jsonl")
    parser.add_argument("--prompts", type=int, default=1000, help="prompt records in prompts.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="draws the questions and their order")
    args = parser.parse_args(argv)
    return exit_code(write_task, args.out, args.count, args.prompts, args.seed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
