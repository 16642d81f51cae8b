"""The rows GRPO trains on (rl/rollout.py): each completion, or agent's episode (rl/episode.py), after its prompt,
right-padded; the labels where the completion's tokens train, and the sampler's log-probabilities beside them."""

import torch

from titanlite.data.packing import padded_width
from titanlite.loss import IGNORED
from titanlite.rl.engine import Completion


def rows(
    prompts: list[list[int]], completions: list[list[int]], trained: list[bool], pad_id: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [n, W]: prompt then completion, right-padded with pad_id; labels the completion's tokens where
    `trained`, W the longest row's (packing.py's padded_width)."""
    longest = max(len(p) + len(c) - 1 for p, c in zip(prompts, completions))
    width = padded_width(longest, seq_len)
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORED, dtype=torch.long)
    for row, (prompt, completion, train) in enumerate(zip(prompts, completions, trained)):
        sequence = torch.tensor(prompt + completion, dtype=torch.long)
        inputs[row, : len(sequence) - 1] = sequence[:-1]
        if train:
            labels[row, len(prompt) - 1 : len(sequence) - 1] = sequence[len(prompt) :]
    return inputs, labels


def aligned_logprobs(prompts: list[list[int]], completions: list[Completion], width: int) -> torch.Tensor:
    """The sampler's log-probabilities [n, W] where the labels hold their tokens (0 elsewhere)."""
    out = torch.zeros(len(prompts), width)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        out[row, len(prompt) - 1 : len(prompt) - 1 + len(completion.logprobs)] = torch.tensor(completion.logprobs)
    return out


def masked_labels(labels: torch.Tensor, prompts: list[list[int]], episodes: list[Completion]) -> torch.Tensor:
    """The labels of rows() IGNORED where an episode's token was inserted (mask 0)."""
    for row, (prompt, episode) in enumerate(zip(prompts, episodes)):
        inserted = torch.tensor([m == 0 for m in episode.mask], dtype=torch.bool)
        start = len(prompt) - 1
        labels[row, start : start + len(inserted)][inserted] = IGNORED
    return labels
