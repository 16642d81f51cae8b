"""The reward functions titanlite ships for reinforcement learning (rl.reward_functions), with TRL's signature.

A reward function is called with keyword arguments, as TRL's GRPOTrainer calls it:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **record_fields) -> list[float | None]

one entry per completion: `completions` are strings, or for chat prompts each a list of messages
([{"role": "assistant", "content": "..."}]); every other field of the prompt records (`answer`, `tests`, ...)
arrives as a list aligned with the completions. None means "this function does not apply to this completion"
(titanlite.rewards.loading.score says how the weighted sum treats it). docs/rewards.md has the whole story.
"""

import re
import threading
from collections.abc import Callable

from titanlite.errors import UserError

# The final number of a completion without a \boxed{}: a sign, digits with optional thousands commas, decimals.
FINAL_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?|[-+]?\.\d+")
BOXED = "\\boxed{"


def completion_text(completion: str | list[dict]) -> str:
    """A completion as text: the string itself, or the content of its last message (the final answer of a chat turn,
    after any tool calls)."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    return completion[-1].get("content") or ""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text (braces inside it balanced), or None where there is none or it is
    open."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position]
    return None


def final_answer(text: str) -> str | None:
    """What math_answer checks: the last \\boxed{...} (as written, boxed) or, where there is none, the final number.
    A last box left open (a completion cut off inside it) is no answer: its digits are not taken for one."""
    if BOXED in text:
        boxed = last_boxed(text)
        return None if boxed is None else f"{BOXED}{boxed}}}"
    numbers = FINAL_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gold_text(answer) -> str | None:
    """A record's answer as math-verify reads it: a number or a string; a bare expression is boxed so that LaTeX
    such as \\frac{1}{2} parses; None or empty: no answer."""
    if answer is None or isinstance(answer, bool):
        return None
    text = str(answer).strip()
    if not text:
        return None
    return text if BOXED in text or "$" in text else f"{BOXED}{text}}}"


def math_answer(completions: list, answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 where the completion's last \\boxed{...} (or, without one, its final number) equals the record's `answer`
    as math-verify judges it (19 = 19.0 = \\frac{38}{2}; 1,234 = 1234), 0.0 where it differs or the completion has
    neither; None where the record has no answer (None or empty) or math-verify cannot parse it, as TRL's
    accuracy_reward does: such a sample is not scored by this function."""
    if answer is None:
        raise UserError(
            "titanlite.rewards:math_answer compares each completion with its prompt record's `answer` field, "
            "which these records lack; add `answer` (the expected result) to every record, or drop math_answer "
            "from rl.reward_functions"
        )
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError(
            "titanlite.rewards:math_answer needs the math-verify package; install it with "
            "pip install 'titanlite[rl]' (or math-verify==0.9.0)"
        ) from None
    # math-verify times out with signal.alarm, which works only in the main thread: elsewhere, no timeout (as TRL).
    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        gold = gold_text(gold)
        gold_parsed = parse(gold, parsing_timeout=seconds) if gold else []
        if not gold_parsed:
            rewards.append(None)
            continue
        predicted = final_answer(completion_text(completion))
        predicted_parsed = parse(predicted, parsing_timeout=seconds) if predicted else []
        rewards.append(float(bool(predicted_parsed) and verify(gold_parsed, predicted_parsed, timeout_seconds=seconds)))
    return rewards


def format_reward(pattern: str, name: str = "format_reward") -> Callable[..., list[float]]:
    """A reward function giving 1.0 where the whole completion matches `pattern` (re.fullmatch, with re.DOTALL so
    that . crosses lines), else 0.0. Make one in a file of your own and name it in rl.reward_functions:

        think_answer = format_reward(r"<think>.*</think>\\s*<answer>.*</answer>\\s*", "think_answer")
    """
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **kwargs) -> list[float]:
        return [1.0 if compiled.fullmatch(completion_text(completion)) else 0.0 for completion in completions]

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"1.0 where the whole completion matches {pattern!r} (re.DOTALL), else 0.0."
    return reward


# The shipped format check: the completion ends with a \boxed{...} answer (whitespace after it allowed), the form
# math_answer reads first.
boxed_format = format_reward(r".*\\boxed\{.+\}\s*", "boxed_format")
