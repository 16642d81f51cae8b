"""rl.tools and rl.environment: the call parser (Qwen3's <tool_call> JSON), the schemas (transformers' get_json_schema,
as TRL builds them), a tool run on a thread that is abandoned past its timeout, and bad input refused in one sentence,
exit 2, before step 1."""

import time

import agent_tools
import pytest
from agent_tools import calling_model, prompts_file
from conftest import ON_CPU
from qwen3_template import QWEN3_TEMPLATE

from titanlite.examples.chat_example import CHATML_TEMPLATE
from titanlite.rl.tools import ToolCall, answer, load_tools, parse_tool_calls, run_with_timeout
from titanlite.train import main

TOOLS = "tests/agent_tools.py"


def test_calls_are_parsed_as_qwen3_writes_them():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert parse_tool_calls("The answer is 5.") == []
    malformed = {
        '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>': "the tool call is not JSON",
        '<tool_call>{"arguments": {}}</tool_call>': 'the tool call has no "name"',
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>': 'the tool call\'s "arguments" is not an object',
        '<tool_call>{"name": "add", "arguments": {}}': "the tool call is not closed by </tool_call>",
    }
    for text, reason in malformed.items():
        (call,) = parse_tool_calls(text)
        assert call.error.startswith(reason), (text, call)


def test_schemas_are_transformers_and_calls_are_answered_as_trl_answers_them():
    from transformers.utils import get_json_schema

    ((name, function, schema),) = load_tools([f"{TOOLS}:add"])
    assert name == "add" and schema == get_json_schema(agent_tools.add) and function(a=2, b=3) == 5
    assert load_tools(["agent_tools:add"])[0][2] == schema  # module:function too
    tools = {"add": agent_tools.add, "broken": agent_tools.broken}
    assert answer(ToolCall("add", {"a": 2, "b": 3}), tools, 5) == ("5", False)
    assert answer(ToolCall("broken", {"a": 2, "b": 3}), tools, 5) == ("{'error': 'no sums today'}", True)
    assert answer(ToolCall("nope", {}), tools, 5) == ("{'error': 'Tool nope not found.'}", True)
    assert answer(ToolCall("add", {"c": 1}), tools, 5)[1]  # wrong arguments: the TypeError is the model's to read
    assert answer(ToolCall(None, None, "the tool call is not JSON"), tools, 5) == (
        "{'error': 'the tool call is not JSON'}",
        True,
    )


def test_a_tool_past_its_timeout_is_abandoned():
    began = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not answer within 0.2 seconds"):
        run_with_timeout(agent_tools.sleepy, {"a": 1, "b": 2}, 0.2)
    assert time.perf_counter() - began < 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    (root / "qwen3.jinja").write_text(QWEN3_TEMPLATE)
    (root / "chatml.jinja").write_text(CHATML_TEMPLATE)
    prompts_file(root / "prompts.jsonl", 4)
    (root / "text.jsonl").write_text('{"prompt": "What is 2 + 3?"}\n' * 4)
    return calling_model(root / "model", QWEN3_TEMPLATE)


def flags(folder, tmp_path, *extra) -> list[str]:
    return [
        *ON_CPU,
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(tmp_path),
        "--training.dataset_format",
        "prompts",
        "--training.dataset_path",
        str(folder.parent / "prompts.jsonl"),
        "--training.chat_template",
        str(folder.parent / "qwen3.jinja"),
        "--training.seq_len",
        "512",
        "--training.steps",
        "1",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--rl.num_generations",
        "2",
        "--rl.max_new_tokens",
        "40",
        "--training.mixed_precision_param",
        "float32",
        *map(str, extra),
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--rl.tools", f"{TOOLS}:untyped"],
            f"rl.tools entry '{TOOLS}:untyped' cannot be described to the model "
            "(TypeHintParsingException: Argument a is missing a type hint",
        ),
        (["--rl.tools", f"{TOOLS}:undocumented"], "cannot be described to the model (DocstringParsingException"),
        (["--rl.tools", f"{TOOLS}:NOT_A_TOOL"], f"rl.tools entry '{TOOLS}:NOT_A_TOOL' names a int, not a function"),
        (["--rl.tools", f"{TOOLS}:add,{TOOLS}:add"], "rl.tools names two tools 'add'"),
        (
            ["--rl.environment", f"{TOOLS}:NoReset", "--rl.reward_functions", f"{TOOLS}:add"],
            "makes NoReset instances without a reset method",
        ),
        (["--rl.environment", f"{TOOLS}:NOT_A_TOOL"], "names a int, which cannot make environments"),
        (["--rl.environment", f"{TOOLS}:Calculator", "--rl.reward_functions", ""], None),
        (
            ["--rl.tools", f"{TOOLS}:add", "--training.chat_template", "CHATML"],
            "writes nothing of the tools it is given, so the model would never see them; set training.chat_template",
        ),
        (["--rl.tools", f"{TOOLS}:add", "--training.dataset_path", "TEXT"], "must be a list of messages, not text"),
        (["--rl.max_tool_calling_iterations", "2"], "rl.max_tool_calling_iterations 2 applies to tool calls"),
        (
            ["--rl.environment", f"{TOOLS}:Unpicklable", "--rl.max_staleness", "1"],
            "makes instances that cannot be pickled (TypeError: cannot pickle '_thread.lock' object), and "
            "rl.max_staleness 1 saves the episodes sampled ahead",
        ),
    ],
)
def test_bad_input_is_one_sentence_exit_2_before_step_1(folder, tmp_path, capsys, extra, message):
    extra = [
        {"CHATML": str(folder.parent / "chatml.jinja"), "TEXT": str(folder.parent / "text.jsonl")}.get(e, e)
        for e in extra
    ]
    if "--rl.reward_functions" not in extra and "--rl.environment" not in extra:
        extra += ["--rl.reward_functions", "titanlite.rewards:math_answer"]
    if message is None:  # the environment's get_reward is the reward: rl.reward_functions may be empty
        assert main(flags(folder, tmp_path, *extra)) == 0
        return
    assert main(flags(folder, tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "step: 1" not in err, err[-2000:]


def test_tool_keys_need_prompts_data(tmp_path, capsys):
    assert (
        main(
            [
                *ON_CPU,
                "--job.config_file",
                "train_configs/debug_model.toml",
                "--job.dump_folder",
                str(tmp_path),
                "--rl.tools",
                f"{TOOLS}:add",
            ]
        )
        == 2
    )
    assert "rl.tools applies to training.dataset_format prompts only" in capsys.readouterr().err
