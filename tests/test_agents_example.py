"""The agent example's parts (scripts/agent_debug.sh, docs/agents.md): the generated tool-calling task, its template
(checked by the agent stage as GRPO checks it: it renders the calculator's schema, calls and results), the calculator
environment, and train_configs/debug_agent.toml as the trainer reads it. The measured run is in docs/agents.md."""

import json

import pytest

from titanlite.config import load_config
from titanlite.config_sections import RL, Model
from titanlite.data.chat import ChatRenderer, Conversations, tokenize_conversation
from titanlite.data.tokenizer import build_tokenizer
from titanlite.examples.arithmetic_tools import Calculator
from titanlite.examples.arithmetic_tools import main as generate
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.rl.episode import Agents, Tools

ENVIRONMENT = "titanlite.examples.arithmetic_tools:Calculator"


def test_the_generated_task_trains_the_calls_and_the_answers(tmp_path):
    assert generate(["--out", str(tmp_path / "task"), "--count", "20", "--prompts", "5"]) == 0
    tokenizer = build_tokenizer(Model(hf_assets_path=str(write_tokenizer_folder(tmp_path / "tokenizer"))))
    template = str(tmp_path / "task" / "tool_template.jinja")
    conversations = Conversations(str(tmp_path / "task" / "sft.jsonl"), "chat", "training.dataset_path")
    ids, trained = tokenize_conversation(ChatRenderer(tokenizer, template), tokenizer, conversations[0], "assistant")
    question = conversations[0][0]["content"]  # "What is a + b?"
    expression, value = question[len("What is ") : -1], conversations[0][2]["content"]
    assert tokenizer.decode([i for i, t in zip(ids, trained) if t]) == (
        f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}</tool_call><|im_end|>'
        f"\\boxed{{{value}}}<|im_end|>"
    )
    assert "<|im_start|>system\nTools: calculate(expression)<|im_end|>" in tokenizer.decode(ids)
    assert Calculator().calculate(expression) == value
    prompts = [json.loads(line) for line in (tmp_path / "task" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 5 and all(set(p) == {"prompt", "answer"} for p in prompts)
    agents = Agents(Tools(RL(environment=ENVIRONMENT)), tokenizer, template, 192)  # the template checks pass
    assert agents.suffix_ids([{"role": "tool", "name": "calculate", "content": "19"}]) == tokenizer.encode(
        "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n", bos=False, eos=False
    )


def test_the_calculator_refuses_what_it_cannot_evaluate():
    assert Calculator().calculate(" 40 - 26 ") == "14" and Calculator().reset(prompt=[], answer="14") is None
    with pytest.raises(ValueError, match="cannot evaluate '2 \\* 3'; write a \\+ b or a - b"):
        Calculator().calculate("2 * 3")


def test_the_grpo_config_reads():
    cfg = load_config(["--job.config_file", "train_configs/debug_agent.toml"])
    assert cfg.rl.environment == ENVIRONMENT and cfg.rl.reward_functions == ["titanlite.rewards:math_answer"]
    assert cfg.training.chat_template.endswith("tool_template.jinja")
