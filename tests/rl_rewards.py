"""Reward functions of the RL tests that no real task would use."""


def never_scores(completions, **_):
    """Returns None for every completion, as a function that cannot score these prompts does."""
    return [None] * len(completions)
