"""The rollout engine's completions (titanlite/rl/engine.py): each sampled token's log-probability is the sampler's
(inference/decode.py's, stop token included), of the very logits it was drawn from at the sampling temperature (a bigram
model whose next-token logits are
known by hand), and a completion ended by a stop token keeps it as sampled, with its log-probability.
That the sampler's log-probabilities equal the trainer's (on one process and from the gathered copy of 2 FSDP
ranks) is tested on real GRPO runs in test_grpo.py. Under tensor parallelism the decode keeps each rank's TP shards
(tp_copy): every family's debug model decodes on 2 ranks what a whole copy decodes, each rank holding half the
key/value heads in its cache, and a stop signal on one rank ends both ranks' decode; the decode's styles
(parallel/tp.py's decode_style) are those of training without sequence parallelism."""

import types

import pytest
import torch
from conftest import torchrun_json
from torch import nn
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from titanlite.inference.decode import Sampling, generate_ids
from titanlite.models.mixtral.parallelize import ExpertParallel
from titanlite.parallel.tp import decode_style, gather_sequence, rowwise_to_sequence, vocab_parallel_plan
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


def test_the_decode_styles_are_trainings_without_sequence_parallelism():
    """Norms and sequence gathers run as they are, the projections compute on their local shards (LocalShards): the
    vocabulary-sharded logits are gathered (with loss parallel or without), a head's projection hands on its local
    heads, the row-wise ones sum their partial outputs unless training leaves them partial, and the shared MoE style is
    left unchanged."""
    assert decode_style(SequenceParallel()) is None and decode_style(gather_sequence(3)) is None
    for loss_parallel in (True, False):
        plan = vocab_parallel_plan(loss_parallel_enabled=loss_parallel)
        embedding, output = decode_style(plan["tok_embeddings"]), decode_style(plan["output"])
        assert (embedding.rows, embedding.partial) == (True, False) and (output.rows, output.gather) == (False, True)
    heads = decode_style(ColwiseParallel())
    assert (heads.rows, heads.gather) == (False, False)
    assert (
        decode_style(rowwise_to_sequence()).partial,
        decode_style(RowwiseParallel(output_layouts=Partial())).partial,
    ) == (False, True)
    experts = ExpertParallel()
    assert decode_style(experts).sequence_parallel is False and experts.sequence_parallel is True


def test_tensor_parallel_decode_keeps_each_ranks_heads_and_equals_a_whole_copy(tmp_path):
    results = torchrun_json("tp_decode_run.py", tmp_path)
    assert set(results) == {"llama3", "qwen3", "qwen3_moe", "mixtral", "gpt2", "deepseek_v3"}
    for family, result in results.items():
        assert result["same_ids"] and result["engine_same"], (family, result)
        assert result["logprob_gap"] < 1e-5, (family, result)
        sharded, whole = result["cache_size"]
        # DeepSeek caches one latent per position, which no head owns: each rank holds it whole
        assert sharded * (1 if family == "deepseek_v3" else 2) == whole, (family, result)
        assert result["stopped"] == [True, True], (family, result)
