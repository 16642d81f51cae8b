"""A tiny generated arithmetic task for the reinforcement-learning example: sums and differences of numbers below 100.

    python -m titanlite.examples.arithmetic --out DIR [--count N] [--prompts M] [--seed S]

writes DIR/sft.jsonl, N chat records to fine-tune on first (training.dataset_format chat):

    {"messages": [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "12 + 7 = 19.
    \\\\boxed{19}"}]}

and DIR/prompts.jsonl, M prompt records for GRPO (training.dataset_format prompts), whose `answer` reaches the
reward functions (titanlite.rewards:math_answer checks the completion's \\boxed{} against it):

    {"prompt": [{"role": "user", "content": "What is 40 - 26?"}], "answer": "14"}

No question is in both files. Differences are never negative. The files depend only on N, M and the seed.
"""

import argparse
import json
import random
import sys
from pathlib import Path

from titanlite.errors import UserError, exit_code

LARGEST = 99  # operands 0..99: two-digit sums a debug-size model learns in minutes


def questions() -> list[tuple[int, str, int]]:
    """Every (a, operator, b) the task asks, in a fixed order: a + b, and a - b where a >= b."""
    sums = [(a, "+", b) for a in range(LARGEST + 1) for b in range(LARGEST + 1)]
    differences = [(a, "-", b) for a in range(LARGEST + 1) for b in range(a + 1)]
    return sums + differences


def result(a: int, operator: str, b: int) -> int:
    return a + b if operator == "+" else a - b


def question_text(a: int, operator: str, b: int) -> str:
    return f"What is {a} {operator} {b}?"


def sft_record(a: int, operator: str, b: int) -> dict:
    value = result(a, operator, b)
    return {
        "messages": [
            {"role": "user", "content": question_text(a, operator, b)},
            {"role": "assistant", "content": f"{a} {operator} {b} = {value}. \\boxed{{{value}}}"},
        ]
    }


def prompt_record(a: int, operator: str, b: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": question_text(a, operator, b)}],
        "answer": str(result(a, operator, b)),
    }


def task(count: int, prompts: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(count SFT records, prompts GRPO records), on distinct questions drawn without replacement by the seed."""
    every = questions()
    if count < 1 or prompts < 1:
        raise UserError(f"--count ({count}) and --prompts ({prompts}) must be at least 1")
    if count + prompts > len(every):
        raise UserError(
            f"--count {count} + --prompts {prompts} is more than the {len(every)} distinct questions the task "
            "has; ask for fewer"
        )
    drawn = random.Random(seed).sample(every, count + prompts)
    return [sft_record(*q) for q in drawn[:count]], [prompt_record(*q) for q in drawn[count:]]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def write_task(out: str, count: int, prompts: int, seed: int) -> None:
    sft, prompt_records = task(count, prompts, seed)
    folder = Path(out)
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"--out {out} cannot be a folder because {blocker} is a file; choose another path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "sft.jsonl", sft)
        write_jsonl(folder / "prompts.jsonl", prompt_records)
    except OSError as error:
        raise UserError(
            f"cannot write the task to --out {out} ({error.strerror or error}); choose a folder you can write to"
        ) from None
    print(
        f"wrote {len(sft)} chat records to {folder / 'sft.jsonl'} and {len(prompt_records)} prompts to "
        f"{folder / 'prompts.jsonl'}"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.examples.arithmetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", required=True, help="the folder to write sft.jsonl and prompts.jsonl to (made if absent)"
    )
    parser.add_argument("--count", type=int, default=2000, help="chat records in sft.jsonl")
    parser.add_argument("--prompts", type=int, default=1000, help="prompt records in prompts.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="draws the questions and their order")
    args = parser.parse_args(argv)
    return exit_code(write_task, args.out, args.count, args.prompts, args.seed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
