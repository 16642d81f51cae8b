import subprocess
import sys

import pytest
from conftest import ROOT, run_titanlite, with_root_on_path

from titanlite.config import load_config, to_toml, write_resolved_config
from titanlite.errors import UserError


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    toml = write(tmp_path, "[training]\nsteps = 5\nseq_len = 128\n[optimizer]\nlr = 1e-3\n")
    cfg = load_config(["--job.config_file", toml, "--training.steps", "7"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == 8  # default


def test_cli_forms_equals_bare_bool_and_lists(tmp_path):
    cfg = load_config(
        [
            "--training.steps=3",
            "--training.deterministic",
            "--metrics.enable_tensorboard",
            "false",
            "--optimizer.betas",
            "0.8,0.99",
            "--lr_scheduler.decay_ratio",
            "-1",
        ]
    )
    assert cfg.training.steps == 3
    assert cfg.training.deterministic is True
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.optimizer.betas == [0.8, 0.99]
    assert cfg.lr_scheduler.decay_ratio == -1.0  # a value that starts with '-' is still a value


def test_float8_alias_section(tmp_path):
    toml = write(tmp_path, '[quantize.linear.float8]\nrecipe_name = "tensorwise"\n')
    assert load_config(["--job.config_file", toml]).float8.recipe_name == "tensorwise"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--training.stepz", "3"],
            "unknown config key training.stepz in the command line; did you mean training.steps?",
        ),
        (["--trainig.steps", "3"], "unknown config section [trainig] in the command line; did you mean [training]?"),
        (["--training.steps", "many"], "training.steps expects an integer, got 'many' in the command line"),
        (["--training.deterministic", "maybe"], "training.deterministic expects a boolean"),
        (
            ["--training.mixed_precision_param", "fp16"],
            "training.mixed_precision_param must be one of bfloat16, float32; got 'fp16'",
        ),
        (["--job.config_file", "/no/such.toml"], "config file /no/such.toml does not exist"),
        (["steps"], "unexpected command-line argument 'steps'"),
        (["--optimizer.betas", "0.9"], "optimizer.betas must hold 2 items; got [0.9] in the command line"),
        (["--optimizer.lr", "inf"], "optimizer.lr must be a finite number at least 0; got inf"),
        (["--validation.steps", "0"], "validation.steps must be at least 1, or -1; got 0 in the command line"),
        (["--activation_checkpoint.selective_ac_option", "0"], "selective_ac_option must be op or a positive integer"),
        (
            ["--activation_checkpoint.selective_ac_option", "two"],
            "selective_ac_option must be op or a positive integer",
        ),
        (
            ["--training.param_dtype", "bfloat16", "--training.mixed_precision_param", "float32"],
            "set training.mixed_precision_param bfloat16 too",
        ),
    ],
)
def test_bad_cli_input(argv, message):
    with pytest.raises(UserError) as error:
        load_config(argv)
    assert message in str(error.value)


def test_toml_errors_name_file_line_and_key(tmp_path):
    broken = write(tmp_path, "[training]\nsteps = 5\nseq_len = \n")
    with pytest.raises(UserError, match=r"job.toml is not valid TOML: .*line 3"):
        load_config(["--job.config_file", broken])
    unknown = write(tmp_path, "[training]\nbatch_size = 5\n")
    with pytest.raises(
        UserError, match=r"unknown config key training.batch_size in .*job.toml; did you mean training.\w+_batch_size\?"
    ):
        load_config(["--job.config_file", unknown])
    wrong_type = write(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(UserError, match="training.steps expects an integer, got 'ten'"):
        load_config(["--job.config_file", wrong_type])
    loose = write(tmp_path, "steps = 5\n")
    with pytest.raises(UserError, match="must sit inside a \\[section\\]"):
        load_config(["--job.config_file", loose])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--training.steps", "11", "--optimizer.betas", "0.5,0.6", "--job.description", 'say "hi"'])
    path = write_resolved_config(cfg, tmp_path / "run")
    again = load_config(["--job.config_file", str(path)])
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    assert to_toml(again) == path.read_text()


def test_help_lists_every_key_with_type_default_and_doc():
    out = subprocess.run([sys.executable, "-m", "titanlite.train", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    assert "--training.steps  integer = 10000" in out.stdout
    assert "optimizer steps to train for" in out.stdout
    assert "--float8.recipe_name  string = 'tensorwise'" in out.stdout
    assert "Adam betas, comma-separated on the CLI (2 items, each at least 0 and below 1)" in out.stdout


def test_user_error_is_one_line_exit_2_no_traceback():
    out = run_titanlite(["--training.stepz", "3"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: unknown config key training.stepz in the command line; did you mean training.steps?"
    ]


def test_every_shipped_train_config_loads():
    configs = sorted((ROOT / "train_configs").glob("*.toml"))
    assert len(configs) >= 9
    for path in configs:
        cfg = load_config(["--job.config_file", str(path)])
        assert cfg.model.flavor and cfg.training.steps > 0, path


def test_readme_reference_documents_every_key_with_its_default():
    import dataclasses

    from titanlite.config import range_text
    from titanlite.config_sections import JobConfig

    reference = (ROOT / "docs" / "configuration.md").read_text().split("## Configuration reference", 1)[1]
    for section in dataclasses.fields(JobConfig):
        table = reference.split(f"**`[{section.name}]`**", 1)[1].split("**`[", 1)[0]
        for f in dataclasses.fields(section.type):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if isinstance(default, list):
                default = ",".join(map(str, default))
            shown = "" if default == "" else f"`{str(default).lower() if isinstance(default, bool) else default}`"
            row = table.split(f"| `{f.name}` |", 1)[-1].split("\n")[0]
            assert f"| `{f.name}` |" in table and f"| {shown} |" in row, (section.name, f.name)
            bounds = range_text(f.metadata)
            assert not bounds or f"({bounds}) |" in row, (section.name, f.name, "the reference row lacks the range")


def test_readme_reference_is_what_the_generator_writes():
    import subprocess
    import sys

    check = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"],
        cwd=ROOT,
        env=with_root_on_path(),
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, "docs/configuration.md's reference is stale: run python scripts/config_reference.py"
