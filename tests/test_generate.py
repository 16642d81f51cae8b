"""python -m titanlite.generate against transformers' generate: random fp32 folders written by transformers
(llama3 with Llama 3.1's RoPE scaling, mistral with a window shorter than the prompt, qwen3, qwen3_moe,
deepseek_v3 with YaRN), two prompts of different lengths in one batch (left-padded), greedy: the new tokens
are transformers' own. Sampling is reproducible from its seed; bad input is one sentence, exit 2."""

import json
import re
import shutil

import pytest
import torch
from conftest import ON_CPU
from test_deepseek_v3 import randomized
from test_deepseek_v3 import small_args as deepseek_args
from test_deepseek_v3 import transformers_model as deepseek_model
from test_hf_folder import LLAMA, MISTRAL, SMALL

from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.generate import main

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 300, 42, 8, 99, 120, 7, 64, 33, 250], [400, 12, 77, 3, 560]]  # 11 and 5 tokens
NEW_TOKENS = 12
STOP_IDS = [0, 2]  # the tokenizer folder's <|endoftext|> and its eos <|im_end|>


def transformers_folder(family: str, folder, tokenizer_folder):
    """A random fp32 model of `family` written by save_pretrained, with the tokenizer files beside it."""
    torch.manual_seed(0)
    if family == "deepseek_v3":
        model = randomized(deepseek_model(deepseek_args(vocab_size=640)), seed=0)
    else:
        config = {
            "llama3": lambda: transformers.LlamaConfig(**LLAMA),
            "mistral": lambda: transformers.MistralConfig(**dict(MISTRAL, sliding_window=8)),  # < 11 + 12 and < 11
            "qwen3": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=96, head_dim=32),
            "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
                **SMALL, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=32
            ),
        }[family]()
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.float().eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


def transformers_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' generate(do_sample=False) on the left-padded batch, each row cut before its first stop token."""
    width = max(map(len, prompts))
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=tokens,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=STOP_IDS,
            pad_token_id=0,
        )[:, width:].tolist()
    return [row[: next((i for i, t in enumerate(row) if t in STOP_IDS), len(row))] for row in out]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


def run_generate(tmp_path, folder, *extra) -> list[dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    output = tmp_path / "out.jsonl"
    assert (
        main(
            [
                *ON_CPU,
                "--model.hf_assets_path",
                str(folder),
                "--generate.prompts_file",
                str(prompts),
                "--generate.max_new_tokens",
                str(NEW_TOKENS),
                "--generate.output",
                str(output),
                *extra,
            ]
        )
        == 0
    )
    return [json.loads(line) for line in output.read_text().splitlines()]


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_greedy_tokens_are_transformers_generate(tmp_path, tokenizer_folder, family):
    folder = tmp_path / family
    theirs = transformers_greedy(transformers_folder(family, folder, tokenizer_folder), PROMPTS)
    ours = run_generate(tmp_path, folder)
    assert [record["token_ids"] for record in ours] == theirs
    assert any(len(row) > 3 for row in theirs)  # not stopped at once: the comparison covers the cached steps


@pytest.mark.extended
def test_the_command_with_generate_compile_gives_the_greedy_tokens_of_transformers(tmp_path, tokenizer_folder):
    """--generate.compile reaches the LM: the compiled decode step's tokens are transformers' greedy ones (the
    compiled step itself is checked family by family in test_inference_api.py)."""
    folder = tmp_path / "llama3"
    theirs = transformers_greedy(transformers_folder("llama3", folder, tokenizer_folder), PROMPTS)
    assert [record["token_ids"] for record in run_generate(tmp_path, folder, "--generate.compile")] == theirs


@pytest.mark.cuda
def test_generation_on_cuda_gives_the_cpu_tokens(tmp_path, tokenizer_folder):
    """The generate Run on one GPU (KV cache on the device, fp32): the greedy tokens of the same run on the CPU."""
    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)
    cpu = run_generate(tmp_path, folder)
    gpu = run_generate(tmp_path, folder, "--job.device", "cuda")
    assert [record["token_ids"] for record in gpu] == [record["token_ids"] for record in cpu]


def generate_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"token_ids": [1, -3, 7]}', 'line 2: "token_ids" holds -3; token ids start at 0'),
        ('{"token_ids": [true, 2]}', 'line 2: "token_ids" must be a non-empty list of integers (not [true, 2])'),
        ('{"token_ids": []}', 'line 2: "token_ids" must be a non-empty list of integers'),
        ('{"prompt": 5}', 'line 2: "prompt" is 5, neither a string nor a list of messages; quote the text'),
        ('{"messages": "hi"}', 'line 2: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "has a message of unknown role 'wizard'"),
        ('{"prompt": "a", "token_ids": [1]}', 'line 2 must hold exactly one of "prompt", "messages" or "token_ids"'),
    ],
)
def test_a_bad_prompt_line_is_one_sentence_naming_the_file_and_line(tmp_path, capsys, line, expected):
    """Checked when the file is read, before the model is built (nothing here would load)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    err = generate_error([*ON_CPU, "--generate.prompts_file", str(prompts)], capsys)
    assert f"generate.prompts_file {prompts}" in err and expected in err


def test_an_empty_prompts_file_is_named_as_empty(tmp_path, capsys):
    for text in ("", "\n  \n"):
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(text)
        err = generate_error([*ON_CPU, "--generate.prompts_file", str(prompts)], capsys)
        assert f"generate.prompts_file {prompts} is empty; write one JSON object per line" in err
    assert "nothing to generate from" in generate_error([*ON_CPU], capsys)


def test_weights_of_another_kind_are_named_before_generating(tmp_path, tokenizer_folder, capsys):
    """An adapters-only LoRA checkpoint under a job without [lora] names lora.rank; a checkpoint of another family
    with the same shapes (a mistral run's, under llama3) is refused by the family, not loaded."""
    from titanlite.train import main as train

    folder = tmp_path / "mistral"
    transformers_folder("mistral", folder, tokenizer_folder)
    run = [
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "--job.dump_folder",
    ]
    assert (
        train([*ON_CPU, "--model.hf_assets_path", str(folder), *run, str(tmp_path / "lora"), "--lora.rank", "4"]) == 0
    )
    assert (
        train([*ON_CPU, "--model.name", "mistral", "--model.flavor", "debugmodel", *run, str(tmp_path / "full")]) == 0
    )
    capsys.readouterr()
    err = generate_error(
        [
            *ON_CPU,
            "--generate.prompt",
            "the",
            "--model.hf_assets_path",
            str(folder),
            "--generate.checkpoint",
            str(tmp_path / "lora" / "checkpoint" / "step-1"),
        ],
        capsys,
    )
    assert "holds LoRA adapters only (rank 4), but lora.rank is 0 here; set lora.rank 4" in err
    err = generate_error(
        [
            *ON_CPU,
            "--generate.prompt",
            "the",
            "--model.name",
            "llama3",
            "--model.flavor",
            "debugmodel",
            "--generate.checkpoint",
            str(tmp_path / "full" / "checkpoint" / "step-1"),
        ],
        capsys,
    )
    assert "holds the weights of mistral/debugmodel" in err and "another model family than this job's llama3/" in err


def test_each_prompt_is_rendered_as_training_renders_it(tmp_path, tokenizer_folder, capsys):
    """Messages give apply_chat_template(add_generation_prompt=True)'s ids exactly (this tokenizer has no bos: none
    is added, not even its eos in the bos's place), text the text pipeline's bos + ids, token ids as given; every
    output line carries them as prompt_token_ids."""
    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the list module"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"messages": messages}, {"prompt": "the list module"}, {"token_ids": [5, 17, 300]}]
        )
    )
    output = tmp_path / "out.jsonl"
    assert (
        main(
            [
                *ON_CPU,
                "--model.hf_assets_path",
                str(folder),
                "--generate.prompts_file",
                str(prompts),
                "--generate.max_new_tokens",
                "2",
                "--generate.output",
                str(output),
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    speed = re.search(
        r"generated 3 completions: prefill [\d.]+ tokens/s \((\d+) tokens in [\d.]+s\), decode [\d.]+ "
        r"tokens/s \((\d+) tokens",
        capsys.readouterr().err,
    )
    assert int(speed[1]) == sum(len(line["prompt_token_ids"]) for line in lines)
    assert int(speed[2]) == sum(len(line["token_ids"]) for line in lines) - 3  # the first tokens come from the prefill
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    templated = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    eos = theirs.convert_tokens_to_ids("<|im_end|>")
    assert lines[0]["prompt_token_ids"] == list(templated) and lines[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert lines[1]["prompt_token_ids"] == [eos] + theirs.encode("the list module", add_special_tokens=False)
    assert lines[2]["prompt_token_ids"] == [5, 17, 300]


def test_sampling_is_seeded_per_prompt(tmp_path, tokenizer_folder):
    """Completion i depends on (seed, i, prompt) only: the same prompt three times gives three samples, the same
    ones in batches of 1 or 3 and with a fourth prompt after them; another seed gives others."""
    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)

    def sampled(count: int, batch_size: int, seed: int = 0) -> list[list[int]]:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text((json.dumps({"token_ids": PROMPTS[0]}) + "\n") * count)
        output = tmp_path / "out.jsonl"
        assert (
            main(
                [
                    *ON_CPU,
                    "--model.hf_assets_path",
                    str(folder),
                    "--generate.prompts_file",
                    str(prompts),
                    "--generate.max_new_tokens",
                    "8",
                    "--generate.temperature",
                    "1",
                    "--generate.batch_size",
                    str(batch_size),
                    "--generate.seed",
                    str(seed),
                    "--generate.output",
                    str(output),
                ]
            )
            == 0
        )
        return [json.loads(line)["token_ids"] for line in output.read_text().splitlines()]

    alone = sampled(3, 1)
    assert len({tuple(ids) for ids in alone}) == 3
    assert sampled(3, 3) == alone and sampled(4, 4)[:3] == alone
    assert sampled(3, 1, seed=1) != alone


def test_a_prompt_too_long_for_the_model_is_named_by_its_line(tmp_path, tokenizer_folder, capsys):
    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + json.dumps({"token_ids": [5] * 100000}) + "\n")
    assert (
        main(
            [
                *ON_CPU,
                "--model.hf_assets_path",
                str(folder),
                "--generate.prompts_file",
                str(prompts),
                "--generate.batch_size",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: ")
    assert f"generate.prompts_file {prompts} line 2 has 100000 tokens, but the model's context is" in err


def test_a_prompt_and_a_prompts_file_together_are_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n')
    err = generate_error([*ON_CPU, "--generate.prompt", "hi", "--generate.prompts_file", str(prompts)], capsys)
    assert f"generate.prompt and generate.prompts_file {prompts} are both set; set one of them" in err


def test_a_grpo_prompts_file_generates_as_it_is(tmp_path, tokenizer_folder):
    """GRPO's records ({"prompt": text or messages, ...fields for the rewards}) give the completions of the same
    prompts written as generate's own records."""
    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)
    messages = [{"role": "user", "content": "the list module"}]

    def completions(records: list[dict]) -> list[dict]:
        prompts, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert (
            main(
                [
                    *ON_CPU,
                    "--model.hf_assets_path",
                    str(folder),
                    "--generate.prompts_file",
                    str(prompts),
                    "--generate.max_new_tokens",
                    "3",
                    "--generate.output",
                    str(output),
                ]
            )
            == 0
        )
        return [json.loads(line) for line in output.read_text().splitlines()]

    grpo = completions([{"prompt": messages, "answer": "5"}, {"prompt": "2 + 3 =", "answer": "5"}])
    assert grpo == completions([{"messages": messages}, {"prompt": "2 + 3 ="}])


def test_the_command_runs_a_fixed_number_of_tokens_as_transformers(tmp_path, tokenizer_folder, capsys):
    """generate.ignore_eos: every completion runs to max_new_tokens, the stop tokens kept as tokens (transformers'
    greedy generate with no stop token); generate.min_new_tokens: no stop token before that many (transformers'
    min_new_tokens); more than max_new_tokens is one sentence."""
    folder = tmp_path / "llama3"
    model = transformers_folder("llama3", folder, tokenizer_folder)
    width = max(map(len, PROMPTS))
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])

    def theirs(**kwargs) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(
                input_ids=tokens,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )[:, width:].tolist()
        stops = kwargs["eos_token_id"] or ()
        return [row[: next((i for i, t in enumerate(row) if t in stops), len(row))] for row in out]

    ignored = [r["token_ids"] for r in run_generate(tmp_path, folder, "--generate.ignore_eos")]
    assert ignored == theirs(eos_token_id=None) and all(len(ids) == NEW_TOKENS for ids in ignored)
    at_least = [r["token_ids"] for r in run_generate(tmp_path, folder, "--generate.min_new_tokens", "5")]
    assert at_least == theirs(eos_token_id=STOP_IDS, min_new_tokens=5)
    capsys.readouterr()
    err = generate_error([*ON_CPU, "--generate.prompt", "hi", "--generate.min_new_tokens", "200"], capsys)
    assert "generate.min_new_tokens 200 passes generate.max_new_tokens 128; lower it" in err


def test_a_long_generation_reports_its_progress(tmp_path, tokenizer_folder, monkeypatch, capsys):
    """The command's progress line (log.py's Progress, here due at every batch instead of every 30 s): prompts
    done of all, time per prompt, time left."""
    import functools

    from titanlite.inference import api
    from titanlite.log import Progress

    folder = tmp_path / "llama3"
    transformers_folder("llama3", folder, tokenizer_folder)
    monkeypatch.setattr(api, "Progress", functools.partial(Progress, every_seconds=0))
    run_generate(tmp_path, folder, "--generate.batch_size", "1")
    lines = [line.split(" INFO ")[-1] for line in capsys.readouterr().err.splitlines() if " INFO generate: " in line]
    assert lines[0].startswith("generate: 1/2 prompts (50%)") and "/prompt" in lines[0] and "left" in lines[0], lines
