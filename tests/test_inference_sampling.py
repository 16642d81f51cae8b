"""The token step's sampling (titanlite/inference/sampling.py, decode.py): draws follow the filtered distribution,
log-probabilities are the sampler's (transformers' log_softmax of logits / temperature), the compiled step samples
the eager tokens for the same seeds, min_new_tokens and ignore_eos mean what transformers' do, and the API's bad
arguments are one sentence each (issue 61.5), checked before torch sees them."""

import math
import re

import numpy as np
import pytest
import torch
from test_generate import PROMPTS, transformers_folder

from titanlite.errors import UserError
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.inference.api import LM
from titanlite.inference.decode import generate_ids
from titanlite.inference.load import load
from titanlite.inference.sampling import Sampling, pick_tokens, prompt_seed

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers' model, its LM)."""
    folder = tmp_path_factory.mktemp("llama3")
    theirs = transformers_folder("llama3", folder, write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer")))
    return theirs, load(folder, device="cpu")


def draws(logits: torch.Tensor, sampling: Sampling, count: int) -> torch.Tensor:
    """`count` tokens drawn from one row of logits, each with its own seed, at counter 0 and 1."""
    seeds = torch.tensor([prompt_seed(0, i) for i in range(count)])
    rows = logits.expand(count, -1)
    return torch.cat([pick_tokens(rows, sampling, seeds, torch.tensor(n))[0] for n in (0, 1)])


def test_draws_follow_the_filtered_distribution():
    """8000 draws: each token's share within 4 standard errors of its probability; top-k and top-p leave out what
    transformers' TopKLogitsWarper and TopPLogitsWarper leave out."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = (logits / 0.8).softmax(-1)[0]
    picked = draws(logits, Sampling(1, temperature=0.8), 4000)
    shares = torch.bincount(picked, minlength=6).double() / len(picked)
    assert ((shares - probs).abs() <= 4 * (probs * (1 - probs) / len(picked)).sqrt() + 1e-3).all()
    warped = transformers.TopPLogitsWarper(0.7)(None, transformers.TopKLogitsWarper(3)(None, logits / 0.8))
    kept = set(torch.isfinite(warped[0]).nonzero()[:, 0].tolist())
    assert set(draws(logits, Sampling(1, temperature=0.8, top_k=3, top_p=0.7), 2000).tolist()) == kept


def test_sampled_logprobs_are_the_samplers(llama):
    """Each sampled token's log-probability is transformers' log_softmax(logits / temperature) at that token, before
    top-k and top-p (the sampler's, as GRPO wants them); greedy's is temperature 1's."""
    theirs, lm = llama
    for completion in lm.generate(PROMPTS, max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=5):
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        with torch.no_grad():
            scaled = (theirs(ids).logits[0, len(completion.prompt_token_ids) - 1 : -1] / 0.7).log_softmax(-1)
        expected = scaled.gather(-1, ids[0, len(completion.prompt_token_ids) :, None])[:, 0]
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_the_compiled_step_samples_the_eager_tokens(tmp_path):
    """compile=True: sampling, top-k, top-p and the per-prompt streams run inside the compiled token step, and draw
    the eager step's tokens for the same seeds (Mistral's ring cache; about 10 s of compilation here)."""
    folder = tmp_path / "mistral"
    transformers_folder("mistral", folder, write_tokenizer_folder(tmp_path / "tokenizer"))
    eager, compiled = load(folder, device="cpu"), load(folder, device="cpu", compile=True)
    prompts = PROMPTS + [PROMPTS[0]]
    kwargs = dict(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=11, ignore_eos=True)
    expected = eager.generate(prompts, **kwargs)
    got = compiled.generate(prompts, **kwargs)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert got[0].token_ids != got[2].token_ids  # one prompt at two places: two streams
    for a, b in zip(got, expected):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # A second compiled LM of the same shapes, other weights, the same call: its own graph, not the first one's with
    # its frozen weights.
    other = load(folder, device="cpu", compile=True)
    with torch.no_grad():
        other.model.output.weight.mul_(-1)
    theirs = LM(other.model, other.args, other.tokenizer, other.device).generate(prompts, **kwargs)
    assert [c.token_ids for c in other.generate(prompts, **kwargs)] == [c.token_ids for c in theirs]
    assert theirs[0].token_ids != expected[0].token_ids


def first_greedy_token_at(lm, prompt: list[int], index: int) -> int:
    [full] = lm.generate([prompt], max_new_tokens=12, ignore_eos=True)
    return full.token_ids[index]


def test_min_new_tokens_and_ignore_eos_mean_what_transformers_does(llama):
    """The token greedy decoding makes third taken as the stop token: transformers' generate with min_new_tokens 6
    holds it back until the sixth token; ignore_eos decodes through it."""
    theirs, lm = llama
    prompt = PROMPTS[0]
    stop = first_greedy_token_at(lm, prompt, 2)
    for min_new in (0, 6):
        with torch.no_grad():
            out = theirs.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=12,
                do_sample=False,
                min_new_tokens=min_new,
                eos_token_id=stop,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        expected = out[: out.index(stop)] if stop in out else out
        [ours] = generate_ids(
            lm.model, lm.args, lm.tokenizer, [prompt], Sampling(12, stop_ids=(stop,), min_new_tokens=min_new)
        )
        assert ours.token_ids == expected and ours.finish_reason == ("eos" if stop in out else "length")
    [through] = generate_ids(lm.model, lm.args, lm.tokenizer, [prompt], Sampling(12, stop_ids=(stop,), ignore_eos=True))
    assert len(through.token_ids) == 12 and through.token_ids[2] == stop and through.finish_reason == "length"


def test_token_ids_as_tensors_and_arrays_are_taken_as_lists(llama):
    _, lm = llama
    expected = [c.token_ids for c in lm.generate(PROMPTS[:1], max_new_tokens=4)]
    assert [c.token_ids for c in lm.generate([torch.tensor(PROMPTS[0])], max_new_tokens=4)] == expected
    assert [c.token_ids for c in lm.generate(np.array(PROMPTS[:1]), max_new_tokens=4)] == expected
    assert torch.equal(lm.logits(np.array(PROMPTS[1])), lm.logits(PROMPTS[1]))
    [one] = lm.generate([PROMPTS[0]], max_new_tokens=12, ignore_eos=True)
    stop = lm.tokenizer.decode(one.token_ids[3:4])
    if stop.strip():  # one string is one stop string (transformers' stop_strings), not its characters
        assert lm.generate([PROMPTS[0]], max_new_tokens=12, stop=stop)[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda lm: lm.generate([]), "generate got an empty list of prompts; give at least one prompt"),
        (
            lambda lm: lm.generate(torch.tensor([1.5, 2.0])),
            "prompts is a 2 array of float32; token ids are whole numbers",
        ),
        (lambda lm: lm.generate([np.array([1.0, 2.0])]), "prompts[0] is a 2 array of float64"),
        (lambda lm: lm.generate([None]), "prompts[0] is a NoneType; give a prompt as each a string"),
        (lambda lm: lm.generate([[1]], stop=[""]), "stop holds an empty string"),
        (lambda lm: lm.generate([[1]], stop=["a", 3]), "stop=['a', 3]: give a string, or a list of strings"),
        (lambda lm: lm.generate([[1]], seed=-1), "seed=-1: give a whole number from 0 to 2**32 - 1"),
        (lambda lm: lm.generate([[1]], seed=1.5), "seed=1.5: give a whole number"),
        (lambda lm: lm.generate([[1]], seed="1"), "seed='1': give a whole number"),
        (lambda lm: lm.generate([[1]], temperature="hot"), "temperature='hot': give 0 (greedy) or more"),
        (lambda lm: lm.generate([[1]], temperature=math.nan), "temperature=nan: give 0 (greedy) or more"),
        (lambda lm: lm.generate([[1]], top_p=0), "top_p=0: give a number above 0 and at most 1"),
        (lambda lm: lm.generate([[1]], top_p=None), "top_p=None: give a number above 0"),
        (lambda lm: lm.generate([[1]], top_k=2.5), "top_k=2.5: give 0 (every token)"),
        (lambda lm: lm.generate([[1]], max_new_tokens=True), "max_new_tokens=True: give a whole number of at least 1"),
        (
            lambda lm: lm.generate([[1]], max_new_tokens=4, min_new_tokens=5),
            "min_new_tokens=5: give a whole number from 0",
        ),
        (lambda lm: lm.generate([[1]], ignore_eos="yes"), "ignore_eos='yes': give True"),
        (
            lambda lm: lm.generate([[1], [2], [1] * 100000], batch_size=1),
            "prompts[2] has 100000 tokens, but the model's",
        ),
        (lambda lm: lm.logits([]), "logits got list []; give a non-empty list of token ids"),
        (lambda lm: lm.logits("hello"), "logits got str hello; give a non-empty list"),
        (lambda lm: lm.logits([[1, 2], [3]]), "not one list of ints nor equally long lists of ints"),
        (lambda lm: lm.logits([1.5, 2]), "not one list of ints nor equally long lists of ints"),
        (lambda lm: lm.logits(torch.ones(2, 2)), "token_ids is a 2x2 array of float32"),
        (lambda lm: lm.logits(np.zeros((1, 1, 2), dtype=np.int64)), "token_ids is a 1x1x2 array of int64"),
    ],
)
def test_a_bad_argument_is_one_sentence(llama, call, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        call(llama[1])
