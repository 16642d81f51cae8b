"""The rollout engine's completions (titanlite/rl/engine.py): each sampled token's log-probability is the sampler's
(inference/decode.py's, stop token included), of the very logits it was drawn from at the sampling temperature (a bigram
model whose next-token logits are
known by hand), and a completion ended by a stop token keeps it as sampled, with its log-probability.
That the sampler's log-probabilities equal the trainer's (on one process and from the gathered copy of 2 FSDP
ranks) is tested on real GRPO runs in test_grpo.py."""

import types

import pytest
import torch
from torch import nn

from titanlite.inference.decode import Sampling, generate_ids
from titanlite.rl.engine import Completion, completion

VOCAB, EOS = 11, 0


class Bigram(nn.Module):
    """Next-token logits that depend only on the current token; the KV cache is ignored."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)))

    def forward(self, tokens, cache=None):
        return self.table[tokens]


class Letters:
    eos_id = EOS

    def encode(self, text, bos=False, eos=False):
        return [1, 2]  # no end-of-turn token is a single token here

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_each_sampled_token_has_the_samplers_logprob_at_the_temperature():
    model, temperature = Bigram(), 0.7
    args = types.SimpleNamespace(max_seq_len=64, vocab_size=VOCAB, sliding_window=None)
    prompts = [[3, 4], [5], [6, 7, 8]]
    generated = generate_ids(model, args, Letters(), prompts, Sampling(20, temperature, seed=1), indices=[0, 1, 2])
    made = [completion(g, 7) for g in generated]
    expected_table = (model.table.detach() / temperature).log_softmax(-1)
    for prompt, done in zip(prompts, made):
        previous = [prompt[-1]] + done.sampled_ids[:-1]
        expected = [expected_table[a, b].item() for a, b in zip(previous, done.sampled_ids)]
        assert done.logprobs == pytest.approx(expected, abs=1e-6) and done.policy_step == 7
    assert any(done.stop_token == EOS for done in made)  # a completion that kept its stop token, with its log-prob


def test_a_completion_ended_by_a_stop_token_keeps_it_as_sampled():
    assert Completion([5, 6], 2, "eos", [-1.0, -2.0, -0.5], 0).sampled_ids == [5, 6, 2]
    assert Completion([5, 6, 7], None, "length", [-1.0, -2.0, -3.0], 0).sampled_ids == [5, 6, 7]
