"""titanlite.load and its LM (titanlite/inference/api.py) on a random fp32 Llama folder written by transformers:
greedy tokens and their log-probabilities are transformers' own, logits equal its forward's, sampling does not
depend on the batch, stop strings and reasons, the three kinds of path, dtype, the docs' example, and errors as one
sentence. The compiled decode step gives the eager tokens: Mistral's here, the other families in the extended tier
(compilation takes 10-25 s each on this CPU), and on CUDA in the cuda tier."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ON_CPU, ROOT
from test_generate import PROMPTS, transformers_folder, transformers_greedy

import titanlite
from titanlite.errors import UserError
from titanlite.examples.chat_example import write_tokenizer_folder

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the folder, transformers' model, its LM)."""
    tokenizer = write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    folder = tmp_path_factory.mktemp("llama3")
    theirs = transformers_folder("llama3", folder, tokenizer)
    return folder, theirs, titanlite.load(folder, device="cpu")


def test_importing_titanlite_does_not_import_torch():
    code = "import sys, titanlite; print('torch' in sys.modules, callable(titanlite.load))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_load_opens_no_process_group(llama):
    """titanlite.load builds the plain model in this process: no process group before, during or after."""
    folder, _, lm = llama
    assert not torch.distributed.is_initialized()
    assert not isinstance(lm.model.output.weight, torch.distributed.tensor.DTensor)


def test_greedy_completions_carry_transformers_tokens_and_logprobs(llama):
    folder, theirs, lm = llama
    completions = lm.generate(PROMPTS, max_new_tokens=12)
    assert [c.token_ids for c in completions] == transformers_greedy(theirs, PROMPTS)
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.prompt_token_ids == prompt
        assert completion.finish_reason == ("length" if len(completion.token_ids) == 12 else "eos")
        assert completion.text == lm.tokenizer.decode(completion.token_ids)
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logprobs = theirs(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        expected = logprobs.gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        with torch.no_grad():
            assert torch.allclose(lm.logits(prompt), theirs(torch.tensor([prompt])).logits[0], atol=1e-4)
    assert lm.logits(torch.tensor([PROMPTS[1], PROMPTS[1]])).shape == (2, len(PROMPTS[1]), 640)


def test_sampling_depends_on_the_prompt_index_only(llama):
    _, _, lm = llama
    prompts = [PROMPTS[0], "the list module", [{"role": "user", "content": "hi"}], PROMPTS[0]]

    def sampled(**kwargs):
        return [c.token_ids for c in lm.generate(prompts, max_new_tokens=8, temperature=1.0, seed=3, **kwargs)]

    together = sampled()
    assert sampled(batch_size=1) == together and sampled(batch_size=3) == together
    assert together[0] != together[3]  # the same prompt at two places: two samples


def test_a_stop_string_ends_the_completion_at_its_token(llama):
    """The token completing the stop string is the last one kept, the text is cut before the string."""
    _, _, lm = llama
    [full] = lm.generate([PROMPTS[0]], max_new_tokens=12)
    decode = lm.tokenizer.decode
    index = next(
        i
        for i in range(1, len(full.token_ids))
        if (piece := decode(full.token_ids[: i + 1])[len(decode(full.token_ids[:i])) :]).strip()
        and piece not in decode(full.token_ids[:i])
    )
    stop = decode(full.token_ids[: index + 1])[len(decode(full.token_ids[:index])) :]
    [cut] = lm.generate([PROMPTS[0]], max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: index + 1]
    assert cut.text == decode(full.token_ids[: index + 1]).split(stop)[0]


def test_load_takes_a_run_folder_a_step_folder_and_a_dtype(llama, tmp_path):
    """A run trained one step from the folder: its dump folder and its step-1 folder give the same (trained) model;
    dtype None keeps the folder's fp32, bfloat16 converts."""
    from titanlite.train import main as train

    folder, _, lm = llama
    run = tmp_path / "run"
    assert (
        train(
            [
                *ON_CPU,
                "--model.hf_assets_path",
                str(folder),
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                "--training.steps",
                "1",
                "--checkpoint.enable",
                "--job.dump_folder",
                str(run),
            ]
        )
        == 0
    )
    from_run, from_step = titanlite.load(run), titanlite.load(run / "checkpoint" / "step-1")
    trained = from_run.logits(PROMPTS[0])
    assert torch.equal(trained, from_step.logits(PROMPTS[0])) and not torch.allclose(trained, lm.logits(PROMPTS[0]))
    assert lm.model.output.weight.dtype == torch.float32
    assert titanlite.load(folder, dtype=torch.bfloat16).model.output.weight.dtype == torch.bfloat16
    # A checkpoint without its checksums: the advice is load()'s keyword, not a config key load() has no way to set.
    shutil.rmtree(run / "checkpoint" / "step-1" / "checksums")
    with pytest.raises(UserError, match=r"cannot be verified.*pass allow_unverified=True to titanlite.load"):
        titanlite.load(run)
    assert torch.equal(titanlite.load(run, allow_unverified=True).logits(PROMPTS[0]), trained)


def test_the_docs_example_runs(llama, capsys):
    """docs/evaluation.md's Python example, its path pointed at the test folder."""
    folder, _, _ = llama
    docs = (ROOT / "docs" / "evaluation.md").read_text()
    code = re.search(r"## From Python: `titanlite.load`\n\n```python\n(.*?)```", docs, re.S)[1]
    exec(code.replace('"outputs/debug_finetune/checkpoint/step-40-hf"', repr(str(folder))), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.split()[0] in ("eos", "stop", "length") for line in lines[:3])
    assert lines[3].startswith("torch.Size([") and lines[3].endswith(", 640])")


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda lm: titanlite.load(Path("/nonexistent/run")), "that is neither a Hugging Face model folder"),
        (lambda lm: titanlite.load(ROOT / "docs", dtype=torch.float16), "dtype=torch.float16: titanlite holds weights"),
        (lambda lm: titanlite.load(ROOT / "docs", device="tpu"), 'device=\'tpu\': give "cpu", "cuda"'),
        (lambda lm: lm.generate("one prompt"), "wrap a single prompt in a list"),
        (lambda lm: lm.generate([5, 17, 300]), "wrap a single prompt in a list"),
        (lambda lm: lm.generate([{"role": "user", "content": "hi"}]), "wrap a single prompt in a list"),
        (lambda lm: lm.generate([[1, -2]]), 'prompts[0]: "token_ids" holds -2'),
        (lambda lm: lm.generate([[1]], temperature=-1), "temperature=-1: give 0 (greedy) or more"),
        (lambda lm: lm.generate([[1]], batch_size=0), "batch_size=0: give a whole number of at least 1"),
        (lambda lm: lm.logits([1, 100000]), "outside the model's vocabulary of 640"),
    ],
)
def test_bad_input_is_one_sentence(llama, call, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        call(llama[2])


def compiled_matches_eager(tmp_path, family: str, device: str) -> None:
    folder = tmp_path / family
    transformers_folder(family, folder, write_tokenizer_folder(tmp_path / "tokenizer"))
    eager, compiled = titanlite.load(folder, device=device), titanlite.load(folder, compile=True, device=device)
    assert compiled.model.output.weight.device.type == device
    expected = [c.token_ids for c in eager.generate(PROMPTS, max_new_tokens=20)]
    assert [c.token_ids for c in compiled.generate(PROMPTS, max_new_tokens=20)] == expected


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("llama3", marks=pytest.mark.extended),
        "mistral",
        pytest.param("qwen3_moe", marks=pytest.mark.extended),
        pytest.param("deepseek_v3", marks=pytest.mark.extended),
    ],
)
def test_the_compiled_decode_step_gives_the_eager_tokens(tmp_path, family):
    """compile=True (CPU inductor, the weights frozen in) against eager, greedy, for the cache's three kinds: keys and
    values, Mistral's ring (a window shorter than the prompt; in the default tier, ~6 s) and DeepSeek's latent; and
    MoE routing (the others in the extended tier: 12-25 s each here)."""
    compiled_matches_eager(tmp_path, family, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama3", "mistral", "deepseek_v3"])
def test_the_compiled_decode_step_on_cuda_gives_the_eager_tokens(tmp_path, family):
    """compile=True on one GPU (inductor's CUDA kernels, fp32 weights, the cache on the device) against eager."""
    compiled_matches_eager(tmp_path, family, "cuda")
