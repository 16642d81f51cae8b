"""Reward functions the GRPO tests name by file path (rl.reward_functions tests/grpo_rewards.py:NAME)."""


def letter_share(completions, **kwargs):
    """A dense toy reward: the share of the letter e in the completion's text."""
    return [text.count("e") / max(len(text), 1) for text in completions]


def wrong_length(completions, **kwargs):
    return [0.0]


def by_answer(completions, answer, **kwargs):
    """The record's field reaches the function: 1 where the completion's text is longer than the answer's number."""
    return [float(len(text) > int(number)) for text, number in zip(completions, answer)]
