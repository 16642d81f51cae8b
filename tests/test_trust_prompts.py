"""Issue 61.2 and 61.5: GRPO's prompts reach the reward functions as the file holds them, a resume refuses prompts that
changed and resumes at its place on another number of data-parallel ranks, and every fault in the prompts is one
sentence naming the file and the one record at fault."""

import json
import shutil

import pyarrow
import pyarrow.parquet
import pytest
from conftest import run_test_script
from test_grpo import grpo_flags

from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
from titanlite.errors import UserError
from titanlite.rl.prompts import PromptOrder, PromptSet
from titanlite.train import main

KEY = "training.dataset_path"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED_TOKENIZER)


def prompt_set(path, tokenizer) -> PromptSet:
    return PromptSet(str(path), tokenizer, "")


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


MIXED = [
    {"prompt": "a", "answer": "007", "flag": "true"},
    {"prompt": "b", "answer": 7, "flag": True},
    {"prompt": "c", "answer": None},
    {"prompt": "d", "tests": ["x"]},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_fields_reach_the_rewards_as_the_file_holds_them(tmp_path, tokenizer, suffix):
    """A column mixing strings and numbers was cast by the Arrow reader: "007" reached the reward as 7, "true" as True.
    A field a record lacks is None, as in a table."""
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(MIXED, indent=1))
    else:
        write_jsonl(path, MIXED)
    prompts = prompt_set(path, tokenizer)
    assert prompts.prompts == ["a", "b", "c", "d"]
    assert prompts.fields == [
        {"answer": "007", "flag": "true", "tests": None},
        {"answer": 7, "flag": True, "tests": None},
        {"answer": None, "flag": None, "tests": None},
        {"answer": None, "flag": None, "tests": ["x"]},
    ]
    assert [type(field["answer"]) for field in prompts.fields[:2]] == [str, int]


def test_parquet_fields_keep_the_files_own_schema(tmp_path, tokenizer):
    path = tmp_path / "prompts.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["a", "b"], "answer": ["007", "7"], "n": [1, 2]}), path)
    assert prompt_set(path, tokenizer).fields == [{"answer": "007", "n": 1}, {"answer": "7", "n": 2}]


@pytest.mark.parametrize(
    "text, fault",
    [
        (
            b'{"prompt": "a"}\n\xff\xfe{"prompt": "b"}\n',
            "is not UTF-8 text (byte 0xff on line 2); re-encode it as UTF-8 or remove it",
        ),
        (b'{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON (Expecting value); fix that line"),
        (
            b'{"prompt": "a"}\n\n[1, 2]\n',
            'line 3 is [1, 2], not a record {"prompt": ..., other fields}; fix or remove it',
        ),
        (
            b'{"prompt": "a"}\n{"question": "b", "answer": 1}\n',
            'line 2 has no field "prompt" (its fields are question, answer), which training.dataset_format prompts '
            "reads",
        ),
        (b'{"prompt": 7}\n', 'line 1: "prompt" is neither text nor a list of messages; fix or remove it'),
        (
            b'{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}, {"role": "robot", "content": "c"}]}\n',
            "line 2 has a message of unknown role 'robot'; use ",
        ),
    ],
)
def test_every_fault_is_one_sentence_naming_the_file_and_one_record(tmp_path, tokenizer, text, fault):
    """A message's fault named the record twice ("record 5: record 1 (counting from 1) has a message ..."); a file that
    is not UTF-8 ended in a traceback of the reader."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(text)
    with pytest.raises(UserError) as refused:
        prompt_set(path, tokenizer)
    said = str(refused.value)
    assert said.startswith(f"{KEY}{':' if 'UTF-8' in fault else ''} {path} {fault}"), said
    assert "counting from 1" not in said and said.count("record") <= 1 and "\n" not in said


def order(path, tokenizer) -> PromptOrder:
    return PromptOrder(prompt_set(path, tokenizer), 2, 0, 1, 0, {"prompts": str(path), "seed": 0, "num_generations": 4})


def test_a_resume_on_changed_prompts_is_refused_in_one_sentence(tmp_path, tokenizer):
    """The prompts cut by one record (or edited) under a checkpoint: the order would be another, so no resume."""
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)])
    saved = order(path, tokenizer)
    saved.next_step()
    state = saved.state_dict()
    assert set(state["identity"]) == {"prompts", "seed", "num_generations", "records", "sha256"}  # no layout
    order(path, tokenizer).load_state_dict(state)  # the same prompts resume
    for records in (
        [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)],
        [{"prompt": f"q{i}", "answer": str(i + (i == 3))} for i in range(6)],
    ):
        write_jsonl(path, records)
        with pytest.raises(UserError) as refused:
            order(path, tokenizer).load_state_dict(state)
        assert str(refused.value) == (
            f"{KEY} {path} changed since the checkpoint was saved (6 records then, {len(records)} now, other "
            "contents): the "
            "run would resume on another order of prompts; resume with the prompts it was saved with, or start a new "
            "run "
            "in another job.dump_folder"
        )
    older = {"identity": {"prompts": str(path), "seed": 0, "num_generations": 4, "dp_world": 2}, "prompts_consumed": 4}
    resumed = order(path, tokenizer)
    resumed.load_state_dict(older)  # a checkpoint from before the checksum, saved on 2 ranks
    assert resumed.consumed == 4


def resumable(prompts, dump, steps) -> list[str]:
    """test_grpo's flags with checkpoints every 2 steps and the rollouts logged."""
    return grpo_flags(
        prompts,
        dump,
        steps,
        "--rl.max_new_tokens",
        "8",
        "--rl.log_rollouts",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "false",
    )


def prompts_by_step(dump) -> dict[int, list]:
    rows = [json.loads(line) for line in (dump / "rollouts.jsonl").read_text().splitlines()]
    return {
        step: [row["prompt_ids"] for row in rows if row["step"] == step]
        for step in sorted({row["step"] for row in rows})
    }


def test_a_resume_on_two_ranks_of_a_one_rank_checkpoint_goes_on_at_its_place(tmp_path):
    """GRPO's prompt order is global: a checkpoint of one process resumed by 2 FSDP ranks reads the prompts an
    uninterrupted run reads next (it restarted them from the beginning, with advice written for text data)."""
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": f"Question {i}: say eeee"} for i in range(12)])
    assert main(resumable(prompts, tmp_path / "whole", 3)) == 0
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([{"argv": resumable(prompts, tmp_path / "resumed", 3)}]))
    out = run_test_script("layout_runs.py", str(spec), nproc=2, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restarts its stream from the beginning" not in out.stderr
    resumed, whole = prompts_by_step(tmp_path / "resumed"), prompts_by_step(tmp_path / "whole")
    assert list(resumed) == [3] and sorted(resumed[3]) == sorted(whole[3]) and len(whole[3]) == 8


def test_a_parquet_file_with_text_that_is_not_utf8_is_one_sentence(tmp_path, tokenizer):
    path = tmp_path / "prompts.parquet"
    text = pyarrow.array([b"Hello?", b"\xffHi."], pyarrow.binary()).view(pyarrow.string())
    pyarrow.parquet.write_table(pyarrow.table({"prompt": text}), path)
    with pytest.raises(UserError) as refused:
        prompt_set(path, tokenizer)
    said = str(refused.value)
    assert (
        said.startswith(f"{KEY}: {path} holds text in 'prompt' that is not UTF-8 (")
        and said.endswith("); re-encode the file as UTF-8 or fix that record")
        and "\n" not in said
    )
