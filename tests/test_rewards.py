"""Reward functions (titanlite/rewards/): the shipped math answer and format checks, loading them from
rl.reward_functions specs with one sentence per mistake, and score() — the reward table and weighted total as TRL
1.16's GRPOTrainer computes them, checked against TRL's own _calculate_rewards on the same inputs."""

import copy
import math
import types

import numpy as np
import pytest
import torch

from titanlite.errors import UserError
from titanlite.rewards import boxed_format, completion_text, final_answer, format_reward, math_answer
from titanlite.rewards.loading import RewardFunction, load_reward_functions, reward_weights, score


def chat(text: str) -> list[dict]:
    """A completion as TRL passes it for a chat prompt."""
    return [{"role": "assistant", "content": text}]


# (completion, the record's answer, math_answer's reward)
MATH_CASES = [
    ("12 + 7 = 19. \\boxed{19}", "19", 1.0),
    ("12 + 7 = 19. \\boxed{19}", 19, 1.0),  # a number as the answer
    ("\\boxed{19.0}", "19", 1.0),
    ("\\boxed{\\frac{38}{2}}", "19", 1.0),  # nested braces, equal by value
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("so it is 19.", "19", 1.0),  # no box: the final number
    ("first 7 then 19 and finally 20", "19", 0.0),  # the final number, not any number
    ("\\boxed{19} no wait \\boxed{20}", "19", 0.0),  # the last box
    ("\\boxed{19}, which is 12 + 7", "19", 1.0),  # a box wins over a later number
    ("the answer is \\boxed{1", "1", 0.0),  # cut off inside the box: no answer, its digit is not taken
    ("no answer here", "19", 0.0),
    ("\\boxed{}", "19", 0.0),
    ("\\boxed{-5}", "-5", 1.0),
    ("\\boxed{19}", None, None),  # no answer in the record: the function does not apply
    ("\\boxed{19}", "", None),
]


def test_math_answer_checks_the_last_box_or_the_final_number():
    completions, answers, expected = map(list, zip(*MATH_CASES))
    assert math_answer(completions=completions, answer=answers) == expected
    # chat completions, and the keyword arguments TRL adds (prompts, completion_ids, other fields), read the same
    assert (
        math_answer(
            prompts=["q"] * len(completions),
            completions=[chat(c) for c in completions],
            completion_ids=[[1]] * len(completions),
            answer=answers,
            tests=[None] * len(completions),
        )
        == expected
    )


def test_math_answer_without_an_answer_field_names_it():
    """Its sentence reaches the user as it is, not as "raised UserError"."""
    function = RewardFunction(spec="titanlite.rewards:math_answer", name="math_answer", function=math_answer)
    with pytest.raises(UserError) as error:
        score([function], reward_weights([], 1), ["q"], ["\\boxed{1}"], [[1]], {"tests": [None]})
    assert str(error.value).startswith(
        "titanlite.rewards:math_answer compares each completion with its prompt record's "
        "`answer` field, which these records lack; add `answer`"
    )


def test_math_answer_agrees_with_trls_accuracy_reward_on_boxed_answers():
    """Where both read the same thing (a LaTeX \\boxed{} answer), titanlite's check and TRL's accuracy_reward agree."""
    accuracy_reward = pytest.importorskip("trl.rewards").accuracy_reward
    cases = [(c, a) for c, a, _ in MATH_CASES if "\\boxed{" in c and a and "cut off" not in c]
    completions, answers = [chat(c) for c, _ in cases], [str(a) for _, a in cases]
    assert math_answer(completions=completions, answer=answers) == accuracy_reward(completions, answers)


def test_completion_text_and_final_answer():
    assert completion_text("plain") == "plain"
    assert (
        completion_text(
            [
                {"role": "assistant", "content": None, "tool_calls": [{}]},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "\\boxed{3}"},
            ]
        )
        == "\\boxed{3}"
    )
    assert completion_text([]) == ""
    assert final_answer("a \\boxed{\\{1,2\\}} b") == "\\boxed{\\{1,2\\}}"
    assert final_answer("costs 1,250.50 dollars") == "1,250.50"
    assert final_answer("none") is None


def test_boxed_format_and_a_pattern_of_ones_own():
    completions = [
        "so \\boxed{19}",
        "so \\boxed{19}\n",
        "\\boxed{19} then more",
        "19",
        chat("x = \\boxed{\\frac{1}{2}}"),
    ]
    assert boxed_format(completions=completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    think = format_reward(r"<think>.*</think>\s*<answer>.*</answer>\s*", "think_answer")
    assert think.__name__ == "think_answer"
    texts = [
        "<think>a\nb</think>\n<answer>3</answer>",
        "<answer>3</answer>",
        "<think>a</think><answer>3</answer> extra",
    ]
    assert think(prompts=["q"] * 3, completions=texts, completion_ids=[[]] * 3) == [1.0, 0.0, 0.0]


def write(path, text: str):
    path.write_text(text)
    return path


def test_load_by_module_and_by_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rl").mkdir()
    write(
        tmp_path / "rl" / "mine.py",
        "from titanlite.rewards import format_reward\n"
        "think = format_reward(r'<think>.*')\n"
        "def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n",
    )
    functions = load_reward_functions(["titanlite.rewards:math_answer", "rl/mine.py:length", "rl/mine.py:think"])
    assert [(f.spec, f.name) for f in functions] == [
        ("titanlite.rewards:math_answer", "math_answer"),
        ("rl/mine.py:length", "length"),
        ("rl/mine.py:think", "think"),
    ]
    assert functions[0].function is math_answer
    # a file is imported once, under a name of its own: loading it again gives the same function
    assert load_reward_functions(["rl/mine.py:length"])[0].function is functions[1].function
    assert functions[1].function.__module__.startswith("titanlite_reward_file_mine_")
    assert functions[1].function(completions=["ab", "c"]) == [2.0, 1.0]


LOAD_MISTAKES = [
    (["math_answer"], "entry 'math_answer' is not path/to/file.py:function or module:function"),
    (["rewards.py:"], "is not path/to/file.py:function"),
    (["missing.py:f"], "names the file missing.py, which does not exist"),
    (["broken.py:f"], "importing broken.py failed (NameError: name 'undefined_name' is not defined); fix the file"),
    (
        ["no_such_module_xyz:f"],
        "importing the module no_such_module_xyz failed (ModuleNotFoundError: No module named 'no_such_module_xyz')",
    ),
    (["titanlite.rewards:no_such_function"], "titanlite.rewards has no attribute 'no_such_function'"),
    (["titanlite.rewards.shipped:BOXED"], "names a str, not a function"),
    (["titanlite.rewards.loading:RewardFunction"], "names a type, not a function"),
    (["titanlite.rewards:math_answer", "titanlite.rewards:math_answer"], "names two functions 'math_answer'"),
    (
        ["a/rewards.py:check", "b/rewards.py:check"],
        "names two functions 'check' (a/rewards.py:check and b/rewards.py:check)",
    ),
    ([], "rl.reward_functions is empty"),
]


@pytest.mark.parametrize("specs, message", LOAD_MISTAKES)
def test_every_loading_mistake_is_one_sentence_naming_the_key_and_spec(specs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "broken.py", "x = 1\nundefined_name\n")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write(
            tmp_path / folder / "rewards.py", "def check(completions, **kwargs):\n    return [1.0] * len(completions)\n"
        )
    with pytest.raises(UserError) as error:
        load_reward_functions(specs)
    text = str(error.value)
    assert message in text and text.startswith("rl.reward_functions") and "\n" not in text
    assert all(spec in text for spec in specs[:1])


def test_reward_weights():
    assert reward_weights([], 3).tolist() == [1.0, 1.0, 1.0]
    assert reward_weights([0.5, 2], 2).dtype == torch.float32
    with pytest.raises(UserError, match=r"rl.reward_weights has 1 weights for 2 reward functions; give one weight per"):
        reward_weights([1.0], 2)
    with pytest.raises(UserError, match=r"rl.reward_weights = \[1.0, inf\] holds a value that is not a finite number"):
        reward_weights([1.0, math.inf], 2)


def reward(name: str, function) -> RewardFunction:
    return RewardFunction(spec=f"tests/mine.py:{name}", name=name, function=function)


def correct(completions, answer, **kwargs):
    return [None if a is None else float(c.endswith(a)) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return np.array([len(c) < 4 for c in completions])  # a numpy array of bools, as some users return


def half(completions, answer, **kwargs):
    return [None if i in (1, 2) else 0.5 for i in range(len(completions))]


async def judged(completions, **kwargs):  # an async function (an LLM judge, say), as TRL allows
    return [torch.tensor(0.25)] * len(completions)


# completion 2 has no answer (correct: None) and half skips it: only short and judged score it
PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["ends 9", "19", "x", "wrong 8"]
FIELDS = {"answer": ["9", "19", None, "7"]}
FUNCTIONS = [reward("correct", correct), reward("short", short), reward("half", half), reward("judged", judged)]
WEIGHTS = [1.0, 0.5, 2.0, -1.0]


def test_score_is_the_weighted_sum_skipping_none():
    per_function, total = score(FUNCTIONS, reward_weights(WEIGHTS, 4), PROMPTS, COMPLETIONS, [[1]] * 4, FIELDS)
    nan = math.nan
    expected = torch.tensor(
        [[1.0, 0.0, 0.5, 0.25], [1.0, 1.0, nan, 0.25], [nan, 1.0, nan, 0.25], [0.0, 0.0, 0.5, 0.25]]
    )
    torch.testing.assert_close(per_function, expected, equal_nan=True)
    torch.testing.assert_close(total, torch.tensor([1.75, 1.25, 0.25, 0.75]))


def test_a_completion_no_function_scores_is_unscorable():
    per_function, total = score(
        FUNCTIONS[:1] + FUNCTIONS[2:3], reward_weights([], 2), PROMPTS, COMPLETIONS, [[1]] * 4, FIELDS
    )
    assert per_function[2].isnan().all() and total[2].isnan()  # TRL: NaN, left out of its group's mean, advantage 0
    torch.testing.assert_close(total[[0, 1, 3]], torch.tensor([1.5, 1.0, 0.5]))


def test_score_equals_trls_calculate_rewards():
    """TRL's GRPOTrainer._calculate_rewards, run on a stand-in for the trainer (its device, its functions and their
    names, and what its profiling reads), gives the same [completions, functions] table. The total is computed
    inside TRL's _generate_and_score_completions, which cannot be called alone: it is checked against the lines
    written out there ((table x weights).nansum(1), rows where every function returned None set to NaN)."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    plain = [f for f in FUNCTIONS if f.name != "judged"]  # TRL runs async functions on its own event loop thread
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(report_to=[]),
        state=types.SimpleNamespace(global_step=0),
        reward_funcs=[f.function for f in plain],
        reward_processing_classes=[None] * len(plain),
        reward_func_names=[f.name for f in plain],
        environments=None,
        _log_completion_extra=None,
        _log_metric=None,
    )
    inputs = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, FIELDS["answer"])]
    table = grpo_trainer.GRPOTrainer._calculate_rewards(trainer, inputs, PROMPTS, COMPLETIONS, [[1]] * 4)
    weights = reward_weights(WEIGHTS[:3], 3)
    per_function, total = score(plain, weights, PROMPTS, COMPLETIONS, [[1]] * 4, FIELDS)
    torch.testing.assert_close(per_function, table, equal_nan=True)
    trl_total = (table * weights.unsqueeze(0)).nansum(dim=1)
    trl_total[torch.isnan(table).all(dim=1)] = torch.nan
    torch.testing.assert_close(total, trl_total, equal_nan=True)


def returns(value):
    return lambda completions, **kwargs: value


def raises(completions, **kwargs):
    raise KeyError("answer")


MISBEHAVIOUR = [
    (raises, "reward function tests/mine.py:f raised KeyError: 'answer'; fix the function"),
    (returns([1.0]), "reward function tests/mine.py:f returned 1 rewards for 4 completions; return one per completion"),
    (returns({"a": 1.0}), "reward function tests/mine.py:f returned a dict, not a list of one reward per completion"),
    (returns(0.5), "reward function tests/mine.py:f returned a float, not a list"),
    (
        returns([1.0, "yes", 0.0, 0.0]),
        "reward function tests/mine.py:f returned 'yes' (a str) for completion 1; a reward is a number",
    ),
    (
        returns([1.0, 0.0, math.inf, 0.0]),
        "reward function tests/mine.py:f returned inf for completion 2; a reward is finite",
    ),
    (
        lambda prompts, completions, completion_ids: [1.0] * 4,
        "reward function tests/mine.py:f raised TypeError: <lambda>() got an unexpected keyword argument 'answer'",
    ),
]


@pytest.mark.parametrize("function, message", MISBEHAVIOUR)
def test_a_function_that_misbehaves_stops_the_run_naming_it(function, message):
    with pytest.raises(UserError) as error:
        score([reward("f", function)], reward_weights([], 1), PROMPTS, COMPLETIONS, [[1]] * 4, FIELDS)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_nan_reads_as_none_and_a_field_may_not_take_an_arguments_name():
    per_function, total = score(
        [reward("f", returns([math.nan, 1, True, np.float32(0.5)]))],
        reward_weights([], 1),
        PROMPTS,
        COMPLETIONS,
        [[1]] * 4,
        FIELDS,
    )
    assert per_function[0, 0].isnan() and total[0].isnan() and total[1:].tolist() == [1.0, 1.0, 0.5]
    with pytest.raises(UserError, match="the prompt records have a field named 'completions'"):
        score(FUNCTIONS, reward_weights([], 4), PROMPTS, COMPLETIONS, [[1]] * 4, {"completions": [1] * 4})


def test_each_function_gets_copies_it_may_edit_in_place():
    """Issue 61.2: a function that pops a trailing eos from completion_ids (and edits the rest) changed the rows GRPO
    trains and logs. Each function gets its own copies: the caller's lists and the next function see the originals."""
    seen = []

    def editor(prompts, completions, completion_ids, answer, **kwargs):
        for ids in completion_ids:
            ids.pop()
        completion_ids.clear()
        prompts[0][0]["content"] = "edited"
        completions[1][0]["content"] = "edited"
        answer[0]["value"] = "edited"
        return [1.0, 1.0]

    def reader(prompts, completions, completion_ids, answer, **kwargs):
        seen.append(copy.deepcopy((prompts, completions, completion_ids, answer)))
        return [0.0, 0.0]

    prompts = [[{"role": "user", "content": "2+2?"}]] * 2  # one prompt's two completions share its messages
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    ids, fields = [[7, 8, 2], [9, 2]], {"answer": [{"value": "4"}, {"value": "4"}]}
    original = copy.deepcopy((prompts, completions, ids, fields))
    per_function, _ = score(
        [reward("editor", editor), reward("reader", reader)], reward_weights([], 2), prompts, completions, ids, fields
    )
    assert (prompts, completions, ids, fields) == original
    assert seen == [(original[0], original[1], original[2], original[3]["answer"])]
    assert per_function.tolist() == [[1.0, 0.0], [1.0, 0.0]]
