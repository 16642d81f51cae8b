"""The multi-stage quick starts (scripts/stages.sh, sourced by finetune_debug.sh and grpo_debug.sh): a stage that
fails or ends without its output stops the script with a sentence naming it and how to resume it, the stages after
it never run, and a rerun skips the finished stages."""

import subprocess

from conftest import ROOT

SCRIPT = """source {root}/scripts/stages.sh
stage 1 "the data" data.txt sh -c 'echo made > data.txt'
stage 2 "the fine-tuning" model.txt sh -c "$SECOND"
last_stage 3 "GRPO" sh -c 'echo grpo ran; echo grpo >> ran.txt'
"""


def run_script(folder, second: str) -> subprocess.CompletedProcess:
    (folder / "quick.sh").write_text(SCRIPT.format(root=ROOT))
    return subprocess.run(
        ["bash", "quick.sh"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "SECOND": second, "STAGES_SCRIPT": "./quick.sh"},
    )


def test_a_failed_stage_is_named_and_the_later_stages_do_not_run(tmp_path):
    out = run_script(tmp_path, "echo training; exit 3")
    assert out.returncode == 3 and not (tmp_path / "ran.txt").exists()
    assert out.stderr.splitlines()[-1] == (
        "./quick.sh: stage 2 (the fine-tuning) failed (exit code 3) and the stages after it did not run; fix what its "
        "last lines say, then rerun ./quick.sh: the finished stages are skipped and a training stage resumes from its "
        "last checkpoint"
    )


def test_a_stage_stopped_cleanly_without_its_output_is_named_and_a_rerun_resumes(tmp_path):
    out = run_script(tmp_path, "echo stopped at step 7 on SIGTERM; exit 0")  # as a trainer that saved and exited
    assert out.returncode == 1 and not (tmp_path / "ran.txt").exists()
    assert out.stderr.splitlines()[-1] == (
        "./quick.sh: stage 2 (the fine-tuning) did not finish (model.txt is missing: it was stopped) and the stages "
        "after it did not run; rerun ./quick.sh to resume it (a training stage from its last checkpoint)"
    )

    again = run_script(tmp_path, "echo trained > model.txt")
    assert again.returncode == 0 and again.stdout == "grpo ran\n"
    assert again.stderr.splitlines() == [
        "stage 1 (the data): done already (data.txt)",
        "stage 2 (the fine-tuning) ...",
        "stage 3 (GRPO) ...",
    ]
