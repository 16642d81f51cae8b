"""The generated arithmetic task (python -m titanlite.examples.arithmetic): chat records titanlite's chat reader takes,
prompts with their answers on other questions, the same files from the same seed, one sentence for a bad --out."""

import json
import re

import pytest

from titanlite.data.chat import Conversations
from titanlite.examples.arithmetic import main, questions
from titanlite.rewards import boxed_format, math_answer


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def asked(content: str) -> tuple[int, str, int]:
    a, operator, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", content).groups()
    return int(a), operator, int(b)


def value(a: int, operator: str, b: int) -> int:
    return a + b if operator == "+" else a - b


def test_the_task_is_sft_chats_and_prompts_on_other_questions(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "task"), "--count", "300", "--prompts", "100", "--seed", "3"]) == 0
    assert "wrote 300 chat records" in capsys.readouterr().out
    sft, prompts = read(tmp_path / "task" / "sft.jsonl"), read(tmp_path / "task" / "prompts.jsonl")
    assert (len(sft), len(prompts)) == (300, 100)
    sft_questions = {asked(r["messages"][0]["content"]) for r in sft}
    prompt_questions = {asked(r["prompt"][0]["content"]) for r in prompts}
    assert len(sft_questions) == 300 and len(prompt_questions) == 100 and not sft_questions & prompt_questions
    assert all(0 <= a <= 99 and 0 <= b <= 99 and value(a, op, b) >= 0 for a, op, b in sft_questions | prompt_questions)
    assert {op for _, op, _ in sft_questions} == {"+", "-"}
    assert all(p["answer"] == str(value(*asked(p["prompt"][0]["content"]))) for p in prompts)
    # the SFT answers are right and in the form both shipped rewards score 1.0
    completions = [r["messages"][1]["content"] for r in sft]
    answers = [str(value(*asked(r["messages"][0]["content"]))) for r in sft]
    assert math_answer(completions=completions, answer=answers) == [1.0] * 300
    assert boxed_format(completions=completions) == [1.0] * 300
    # titanlite's chat reader (training.dataset_format chat) takes the file as it is
    conversations = Conversations(str(tmp_path / "task" / "sft.jsonl"), "chat", "training.dataset_path")
    assert len(conversations) == 300 and conversations[0] == sft[0]["messages"]


def test_the_files_depend_only_on_the_seed(tmp_path):
    made = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        assert main(["--out", str(tmp_path / name), "--count", "50", "--prompts", "20", "--seed", str(seed)]) == 0
        made[name] = [(tmp_path / name / f).read_bytes() for f in ("sft.jsonl", "prompts.jsonl")]
    assert made["a"] == made["b"] and made["a"][0] != made["c"][0] and made["a"][1] != made["c"][1]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--out", "{file}/task"],
            "error: --out {file}/task cannot be a folder because {file} is a file; choose another path",
        ),
        (["--out", "{tmp}/task", "--count", "0"], "error: --count (0) and --prompts (1000) must be at least 1"),
        (
            ["--out", "{tmp}/task", "--count", "15000", "--prompts", "51"],
            "error: --count 15000 + --prompts 51 is more than the 15050 distinct questions the task has; ask for fewer",
        ),
    ],
)
def test_a_bad_request_is_one_sentence(args, message, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fill = lambda text: text.format(file=tmp_path / "file", tmp=tmp_path)  # noqa: E731
    assert main([fill(arg) for arg in args]) == 2
    assert capsys.readouterr().err == fill(message) + "\n"
    assert not (tmp_path / "task").exists()
    assert len(questions()) == 15050
