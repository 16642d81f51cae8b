"""python -m titanlite.eval (lm-eval with titanlite as its model) against lm-eval's own hf model on the same
random fp32 folder written by transformers, on local tasks (dataset_path json, data files made here):
multiple choice gives the same acc and acc_norm, generate_until the same outputs, loglikelihood_rolling
the same log-likelihoods within 1e-6 (relative); bad input is one sentence, exit 2."""

import contextlib
import json
import re
import shutil
from types import SimpleNamespace

import pytest
from test_generate import transformers_folder

from titanlite.config import load_config
from titanlite.eval import evaluate_model, main
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.inference.model import build_inference_model
from titanlite.inference.tasks import metric_scalars
from titanlite.parallel.dist import close_distributed, init_distributed

lm_eval = pytest.importorskip("lm_eval")

WORDS = ["the", "list", "module", "returns", "a", "value", "when", "called", "with", "an", "object", "string", "file"]


def records(count: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [
        {
            "question": " ".join(rng.choices(WORDS, k=6)),
            "choices": [" ".join(rng.choices(WORDS, k=rng.randint(1, 3))) for _ in range(4)],
            "answer": rng.randrange(4),
            "text": " ".join(rng.choices(WORDS, k=rng.choice([20, 400]))),
        }
        for _ in range(count)
    ]


TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: 'Q: {{question}}\\nA:'\ndoc_to_target: '{{choices[0]}}'\n"
    "generation_kwargs:\n  until: ['\\n\\n', 'Q:']\n  max_gen_toks: 10\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n",
    "tiny_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the model folder, the task folder)."""
    root = tmp_path_factory.mktemp("eval")
    transformers_folder("llama3", root / "model", write_tokenizer_folder(root / "tokenizer"))
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(12, seed=0)))
    for name, body in TASKS.items():
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}"
        )
    return root / "model", tasks


@pytest.fixture(scope="module")
def both(setup):
    """(lm-eval's hf model's results, titanlite's), with the samples."""
    folder, tasks = setup
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    theirs = simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        batch_size=4,
        device="cpu",
    )
    with one_process_run(load_config(["--model.hf_assets_path", str(folder), "--job.device", "cpu"])) as loaded:
        ours = evaluate_model(loaded, list(TASKS), str(tasks), batch_size=4, log_samples=True)
    return theirs, ours


@contextlib.contextmanager
def one_process_run(cfg):
    """The generate/eval model of `cfg` in this process (a world of one)."""
    try:
        yield build_inference_model(cfg, init_distributed("cpu", 60))
    finally:
        close_distributed()


def responses(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_accuracy_is_lm_evals_hf_models(both):
    theirs, ours = both
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]
    ours_ll = [float(choice[0]) for r in responses(ours, "tiny_mc") for choice in r]
    theirs_ll = [float(choice[0]) for r in responses(theirs, "tiny_mc") for choice in r]
    assert ours_ll == pytest.approx(theirs_ll, rel=1e-5)
    assert 0 < metric_scalars(ours)["tiny_mc/acc"] < 1


def test_generate_until_outputs_are_lm_evals_hf_models(both):
    theirs, ours = both
    assert responses(ours, "tiny_gen") == responses(theirs, "tiny_gen")
    assert any(r[0].strip() for r in responses(ours, "tiny_gen"))


def test_rolling_loglikelihoods_are_lm_evals_hf_models_within_1e_6(both):
    theirs, ours = both
    got = [r[0] if isinstance(r, list) else r for r in responses(ours, "tiny_rolling")]
    expected = [r[0] if isinstance(r, list) else r for r in responses(theirs, "tiny_rolling")]
    assert got == pytest.approx(expected, rel=1e-6)


def test_cli_writes_lm_evals_results_json(setup, tmp_path, capsys):
    folder, tasks = setup
    assert (
        main(
            [
                "--tasks",
                "tiny_mc",
                "--include_path",
                str(tasks),
                "--limit",
                "4",
                "--output_path",
                str(tmp_path / "out"),
                "--model_args",
                f"hf_assets_path={folder},job.device=cpu",
            ]
        )
        == 0
    )
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1
    assert "acc,none" in json.loads(written[0].read_text())["results"]["tiny_mc"]


def test_in_loop_evaluator_writes_the_scalars_lm_eval_gives(setup, both, tmp_path):
    """The evaluator the trainer calls, on the live model: every interval and the last step, the values of
    python -m titanlite.eval as eval/<task>/<metric> scalars, a sample completion in the text tab, the model
    back in training mode and the time left out of the next tps."""
    import torch
    from conftest import ON_CPU, tensorboard_scalars

    from titanlite.evaluation.in_loop import InLoopEvaluator
    from titanlite.metrics import MetricsLogger
    from titanlite.metrics.tensorboard import run_folder

    folder, tasks = setup
    prompts = tmp_path / "samples.jsonl"
    prompts.write_text(json.dumps({"prompt": "the list module"}) + "\n")
    cfg = load_config(
        [
            *ON_CPU,
            "--model.hf_assets_path",
            str(folder),
            "--job.dump_folder",
            str(tmp_path),
            "--metrics.enable_tensorboard",
            "true",
            "--eval.tasks",
            "tiny_mc",
            "--eval.include_path",
            str(tasks),
            "--eval.interval",
            "3",
            "--eval.at_end",
            "true",
            "--eval.batch_size",
            "4",
            "--eval.sample_prompts",
            str(prompts),
            "--eval.max_new_tokens",
            "4",
            "--training.steps",
            "7",
        ]
    )
    with one_process_run(cfg) as run:
        metrics = MetricsLogger(cfg.metrics, 0, torch.device("cpu"), 0.0)
        metrics.start_tensorboard(run_folder(cfg, 0, 0), cfg, 0, {})
        evaluator = InLoopEvaluator(run, SimpleNamespace(metrics=metrics, steps=7))  # what it reads of a Training
        assert [step for step in range(1, 8) if evaluator.should_evaluate(step)] == [3, 6, 7]
        run.model.train()
        started = metrics.started
        scalars = evaluator.evaluate(3)
        metrics.close()
        assert run.model.training and metrics.started > started
    expected = both[1]["results"]["tiny_mc"]
    assert scalars == {"tiny_mc/acc": expected["acc,none"], "tiny_mc/acc_norm": expected["acc_norm,none"]}
    assert tensorboard_scalars(tmp_path / "tb", "eval/tiny_mc/acc") == {3: pytest.approx(expected["acc,none"])}
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def error_of(argv: list[str], capsys, entry=main) -> str:
    assert entry(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: "), err
    return err.splitlines()[-1]


def test_bad_tasks_and_weights_are_one_sentence(setup, tmp_path, capsys):
    folder, tasks = setup
    flags = ["--model_args", f"hf_assets_path={folder},job.device=cpu"]
    assert "unknown task 'tiny_nothing'" in error_of(
        ["--tasks", "tiny_nothing", "--include_path", str(tasks), *flags], capsys
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.yaml").write_text("task: bad\ndoc_to_text: [unclosed\n")
    assert f"the task file {broken / 'bad.yaml'} does not parse" in error_of(
        ["--tasks", "bad", "--include_path", str(broken), *flags], capsys
    )
    # A folder of another shape: the same family, twice as many kv heads.
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=4)))
    assert "does not fit" in error_of(
        ["--tasks", "tiny_mc", "--include_path", str(tasks), "--model_args", f"hf_assets_path={other},job.device=cpu"],
        capsys,
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--limit", "0"], "--limit 0 leaves no examples to evaluate"),
        (["--limit", "-3"], "--limit -3 leaves no examples to evaluate"),
        (["--batch_size", "0"], "--batch_size 0: titanlite takes a number of sequences per forward of at least 1"),
        (["--batch_size", "auto"], "--batch_size auto: titanlite takes a number"),
        (["--tasks", " , "], "--tasks names no task; give comma-separated lm-eval task or group names"),
        (["--limit", "inf"], "--limit inf is no number of examples"),
        (["--limit", "nan"], "--limit nan is no number of examples"),
        (["--output_path", "/proc/titanlite-results"], "--output_path /proc/titanlite-results cannot be written"),
    ],
)
def test_bad_eval_flags_are_one_sentence(setup, capsys, flags, expected):
    folder, tasks = setup
    argv = [
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(tasks),
        "--model_args",
        f"hf_assets_path={folder},job.device=cpu",
    ]
    assert expected in error_of([*argv, *flags], capsys)


def test_more_few_shot_examples_than_a_task_has_is_one_sentence(setup, capsys):
    """lm-eval would stop with random.sample's ValueError while it builds the prompts (before any forward)."""
    folder, tasks = setup
    argv = [
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(tasks),
        "--num_fewshot",
        "20",
        "--limit",
        "2",
        "--model_args",
        f"hf_assets_path={folder},job.device=cpu",
    ]
    assert "a task of tiny_mc has fewer examples to show than --num_fewshot 20 asks for" in error_of(argv, capsys)


def test_the_cli_prints_lm_evals_table_and_records_the_evaluation_time(setup, tmp_path, capsys):
    folder, tasks = setup
    assert (
        main(
            [
                "--tasks",
                "tiny_mc",
                "--include_path",
                str(tasks),
                "--limit",
                "4",
                "--output_path",
                str(tmp_path),
                "--model_args",
                f"hf_assets_path={folder},job.device=cpu",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    table = captured.out
    assert re.search(
        r"evaluated tiny_mc in [\d.]+s: prefill [\d.]+ tokens/s \(\d+ tokens in [\d.]+s\), decode none", captured.err
    )
    assert "| Tasks |" in table and "tiny_mc" in table and "|acc_norm|" in table
    written = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert 0.05 < float(written["total_evaluation_time_seconds"]) < 120  # the model's forwards, not the save alone


def test_an_unknown_eval_task_stops_the_run_before_its_first_step(tmp_path):
    """[eval] tasks are checked when the trainer builds its evaluator, before step 1 (not at the first evaluation,
    after the steps before it trained unsaved)."""
    from conftest import run_titanlite

    out = run_titanlite(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "2",
            "--eval.tasks",
            "nosuchtask",
            "--eval.at_end",
            "true",
        ]
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: unknown task 'nosuchtask'")
    assert "step: 1" not in out.stdout + out.stderr


def test_eval_tasks_that_would_never_run_are_refused():
    from titanlite.errors import UserError

    with pytest.raises(UserError, match="eval.tasks is set but eval.interval is 0 and eval.at_end false"):
        load_config(["--eval.tasks", "hellaswag"])
    assert load_config(["--eval.tasks", "hellaswag", "--eval.at_end", "true"]).eval.tasks == ["hellaswag"]


def test_bad_generation_input_is_one_sentence(setup, tmp_path, capsys):
    from titanlite.generate import main as generate

    folder, _ = setup
    flags = ["--job.device", "cpu", "--model.hf_assets_path", str(folder)]
    assert "generate.temperature" in error_of(
        [*flags, "--generate.prompt", "x", "--generate.temperature", "-1"], capsys, generate
    )
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"token_ids": [5] * 256}) + "\n")
    assert "the model's context is 256" in error_of([*flags, "--generate.prompts_file", str(long)], capsys, generate)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"token_ids": [5, 100000]}) + "\n")
    assert (
        f'generate.prompts_file {outside} line 1: "token_ids" holds 100000, outside the tokenizer\'s vocabulary'
        in error_of([*flags, "--generate.prompts_file", str(outside)], capsys, generate)
    )
    assert "eval.interval" in error_of([*flags, "--generate.prompt", "x", "--eval.interval", "10"], capsys, generate)


def test_two_fsdp_ranks_share_the_requests_and_generate_as_one_process(setup, both, tmp_path):
    """The generate/eval Run sharded over 2 FSDP ranks: the in-loop evaluator with the ranks sharing the requests of
    all three kinds gives one process's values, and each rank generating for its own prompt and length, in
    lockstep, gives the greedy tokens one process gives for that prompt."""
    from conftest import torchrun_json
    from eval_fsdp_run import NEW_TOKENS, PROMPTS, inference_config

    from titanlite.inference.decode import Sampling, generate_ids

    folder, tasks = setup
    sharded = torchrun_json("eval_fsdp_run.py", tmp_path, str(folder), str(tasks))
    expected = metric_scalars(both[1])
    assert sharded["scalars"].keys() == expected.keys()
    assert sharded["scalars"] == pytest.approx(expected, rel=1e-9)
    with one_process_run(inference_config(str(folder))) as run:
        alone = [
            generate_ids(run.model, run.args, run.tokenizer, [prompt], Sampling(count, stop_ids=()))[0].token_ids
            for prompt, count in zip(PROMPTS, NEW_TOKENS)
        ]
    assert sharded["generated"] == alone and [len(ids) for ids in alone] == NEW_TOKENS
