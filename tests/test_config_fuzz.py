"""A fuzz test generated from the config schema: every key, given a value of the wrong type or (for
numeric keys) one just outside each declared bound, stops the run before anything starts, through
the same main() as `python -m titanlite.train`: exit code 2, one line naming the key, no traceback.

A numeric key without a declared range fails here, so a new key cannot skip declaring one.
"""

import dataclasses
import math
import typing

import pytest
from conftest import DEBUG_CONFIG

from titanlite.config_sections import JobConfig
from titanlite.train import main

KEYS = {f"{s.name}.{f.name}": f for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(s.type)}
# The outward direction of each bound and whether the bound itself is allowed.
BOUNDS = {"at_least": (-1, True), "above": (-1, False), "at_most": (1, True), "below": (1, False)}
# A TOML literal of another type than the field's.
WRONG_TYPE = {bool: '"maybe"', int: '"seven"', float: '"x"', str: "7"}


def item_type(f: dataclasses.Field) -> type:
    return typing.get_args(f.type)[0] if typing.get_origin(f.type) is list else f.type


def is_numeric(f: dataclasses.Field) -> bool:
    return item_type(f) in (int, float)


def step_out(value, direction: int, tp: type):
    return value + direction if tp is int else math.nextafter(value, direction * math.inf)


def just_outside(f: dataclasses.Field) -> list:
    """For each declared bound, the nearest value beyond it that is not an allowed sentinel."""
    values = []
    for name, (direction, inclusive) in BOUNDS.items():
        bound = f.metadata[name]
        if bound is None:
            continue
        value = step_out(bound, direction, item_type(f)) if inclusive else item_type(f)(bound)
        while value in f.metadata["sentinels"]:
            value = step_out(value, direction, item_type(f))
        values.append(value)
    return values


def cli_text(f: dataclasses.Field, value) -> str:
    """The value as a command-line word; for a list field, the default list with its first item replaced."""
    if typing.get_origin(f.type) is list:
        default = f.default_factory()
        return ",".join(repr(v) for v in [value, *default[1:]])
    return repr(value)


def run_main(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    monkeypatch.delenv("RANK", raising=False)  # main prints on rank 0 only
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def assert_one_sentence(code: int, lines: list[str], *needles: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in lines[0], lines
    for needle in needles:
        assert needle in lines[0], (needle, lines)


@pytest.mark.parametrize(
    "key", [key for key in KEYS if key != "job.config_file"]
)  # refused in a TOML whatever its type
def test_wrong_type_in_toml_names_the_key(key, tmp_path, capsys, monkeypatch):
    section, name = key.split(".")
    f = KEYS[key]
    literal = '"not a list"' if typing.get_origin(f.type) is list else WRONG_TYPE[f.type]
    toml = tmp_path / "job.toml"
    toml.write_text(f"[{section}]\n{name} = {literal}\n")
    code, lines = run_main(["--job.config_file", str(toml)], capsys, monkeypatch)
    assert_one_sentence(code, lines, f"{key} expects", str(toml))


@pytest.mark.parametrize("key", [key for key, f in KEYS.items() if is_numeric(f)])
def test_numeric_key_just_outside_each_bound_names_the_key(key, capsys, monkeypatch):
    f = KEYS[key]
    values = just_outside(f)
    assert values, f"{key} declares no range; give its opt() at_least=/above=/at_most=/below="
    for value in values:
        code, lines = run_main([f"--{key}", cli_text(f, value)], capsys, monkeypatch)
        assert_one_sentence(code, lines, key)
    if f.metadata["length"] is not None:
        too_long = ",".join(map(repr, f.default_factory() + f.default_factory()[:1]))
        code, lines = run_main([f"--{key}", too_long], capsys, monkeypatch)
        assert_one_sentence(code, lines, key, f"must hold {f.metadata['length']} items")


def test_every_default_is_in_its_range():
    # The bounds themselves are allowed: a default sitting on one (e.g. warmup 0) must load.
    from titanlite.config import load_config

    assert load_config([]) == JobConfig()


@pytest.mark.parametrize(
    "flags, sentence",
    [
        (["--optimizer.lr", "-0.001"], "optimizer.lr must be at least 0; got -0.001 in the command line"),
        (["--optimizer.betas", "1.5,0.95"], "each item of optimizer.betas must be at least 0 and below 1; got 1.5"),
        (["--optimizer.eps", "-1e-8"], "optimizer.eps must be above 0; got -1e-08"),
        (["--training.num_workers", "-1"], "training.num_workers must be at least 0; got -1"),
        (["--metrics.log_freq", "0"], "metrics.log_freq must be at least 1; got 0"),
        # issue 42: keys that conflicted quietly
        (
            ["--training.max_nonfinite_skips", "3"],
            "training.max_nonfinite_skips 3 counts skipped steps, but training.on_nonfinite stop never skips one",
        ),
    ],
)
def test_issue_commands_end_in_one_sentence(flags, sentence, capsys, monkeypatch):
    """The config mistakes listed at the top of issue 13, with the debug config as a user types them."""
    code, lines = run_main(["--job.config_file", DEBUG_CONFIG, *flags], capsys, monkeypatch)
    assert_one_sentence(code, lines, sentence)


def test_a_config_file_naming_another_config_file_is_refused(tmp_path, capsys, monkeypatch):
    """Issue 42: job.config_file inside a TOML read as an include that never happened."""
    toml = tmp_path / "job.toml"
    toml.write_text(f'[job]\nconfig_file = "{DEBUG_CONFIG}"\n')
    code, lines = run_main(["--job.config_file", str(toml)], capsys, monkeypatch)
    assert_one_sentence(code, lines, f"{toml} sets job.config_file, which only the command line can set")


def test_prepare_names_its_own_flags(tmp_path, capsys):
    """Issue 42: `prepare --output` naming a file, and `--format chat` with no template, name prepare's flags."""
    from titanlite.data.prepare import main as prepare_main

    taken = tmp_path / "a_file"
    taken.write_text("x")
    assert prepare_main(["--input", "sample", "--output", str(taken / "store")]) == 2
    assert f"--output {taken / 'store'} cannot be a folder because {taken} is a file" in capsys.readouterr().err
    assert prepare_main(["--input", "chats.jsonl", "--output", str(tmp_path / "s"), "--format", "chat"]) == 2
    assert "add --tokenizer" in capsys.readouterr().err


def test_a_config_json_number_written_as_text_is_one_sentence(tmp_path, capsys, monkeypatch):
    """Issue 42: "hidden_size": "256" raised TypeError deep in the model args, in train and in plan."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": "256"}')
    code, lines = run_main(
        ["--job.config_file", DEBUG_CONFIG, "--model.hf_assets_path", str(tmp_path)], capsys, monkeypatch
    )
    assert_one_sentence(code, lines, f'{tmp_path / "config.json"}: "hidden_size" is "256", which is not a number')


def test_chat_records_that_are_not_utf8_name_the_file_and_line(tmp_path):
    """Issue 42: pyarrow kept the bytes and a UnicodeDecodeError surfaced when a record was read (training,
    validation and prepare all read chat records through Conversations)."""
    from titanlite.data.chat import Conversations
    from titanlite.errors import UserError

    data = tmp_path / "chats.jsonl"
    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
    data.write_bytes(good + good.replace(b"hi", b"caf\xe9"))
    with pytest.raises(UserError, match=f"training.dataset_path: {data} is not UTF-8 text \\(byte 0xe9 on line 2\\)"):
        Conversations(str(data), "chat", "training.dataset_path")
