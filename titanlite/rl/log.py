"""GRPO's record of its rollouts (rl.log_rollouts): <dump_folder>/rollouts.jsonl, one JSON line per completion of
every rollout batch that trained, written by rank 0, and rl.log_completions' console lines.

The file is the run's record: the first batch a run writes first drops every line of a step at or after its own
(a resume's lines after the checkpoint it resumed from, another run's lines in a reused folder), so each step that
trained is there once. Whether it can be written is checked at start-up, before any rollout.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.rl.engine import Completion
from titanlite.rl.episode import Episode
from titanlite.rl.prompts import PromptItem

SHOWN = 4  # completions rl.log_completions prints per rollout batch


def number(value: float) -> float | None:
    """A reward as JSON has it: None where no function scored (NaN)."""
    return None if value != value else value


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class RolloutLog:
    def __init__(self, path: Path, sharing: int):
        self.path, self.sharing = path, sharing  # sharing: neighbouring ranks holding the same rows (a TP group)
        self.started = False  # whether this run has written (and so cut the file to its own steps) yet

    @classmethod
    def at(cls, dump_folder: str, sharing: int) -> "RolloutLog":
        """The log of a run in `dump_folder`, its file checked writable now."""
        path = Path(dump_folder) / "rollouts.jsonl"
        if is_rank_zero():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a"):
                    pass
            except OSError as error:
                raise UserError(
                    f"rl.log_rollouts writes {path}, which cannot be written ({error.strerror or error}); "
                    "make job.dump_folder writable or set rl.log_rollouts false"
                ) from None
        return cls(path, sharing)

    def lines(
        self,
        step: int,
        owners: list[PromptItem],
        completions: list[Completion],
        texts: list[str],
        names: list[str],
        per_function: torch.Tensor,
        total: torch.Tensor,
        advantages: torch.Tensor,
    ) -> list[str]:
        return [
            json.dumps(
                {
                    "step": step,
                    "policy_step": c.policy_step,
                    "prompt": item.prompt,
                    "completion": text,
                    "prompt_ids": item.ids,
                    "completion_ids": c.sampled_ids,
                    "logprobs": c.logprobs,
                    "rewards": {name: number(value) for name, value in zip(names, rewards)},
                    "reward": number(r),
                    "advantage": a,
                }
                | episode_fields(c)
            )
            for item, c, text, rewards, r, a in zip(
                owners, completions, texts, per_function.tolist(), total.tolist(), advantages.tolist()
            )
        ]

    def write(self, step: int, *rows) -> None:
        """Every rank's completions of the rollout batch first trained at `step`, one JSON line each (rank 0 writes);
        rows: lines()'s arguments after the step."""
        lines = self.lines(step, *rows)
        everyone = [lines]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, lines)
            everyone = everyone[:: self.sharing]  # a TP group's ranks hold the same completions
        if not is_rank_zero():
            return
        if not self.started:
            self.keep_steps_before(step)
            self.started = True
        with self.path.open("a") as out:
            out.writelines(line + "\n" for part in everyone for line in part)

    def keep_steps_before(self, step: int) -> None:
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if (written := step_of(line)) is not None and written < step]
        self.path.write_text("".join(kept))


def episode_fields(c: Completion) -> dict:
    """An agent's episode (rl/episode.py): its own prompt (rendered with the tools), which completion tokens are the
    model's (1) or inserted (0), and the tool calls answered."""
    if not isinstance(c, Episode):
        return {}
    return {"prompt_ids": c.prompt_ids, "completion_mask": c.mask, "tool_calls": c.tool_calls}


def step_of(line: str) -> int | None:
    """A line's step; None for a line a killed run left half written."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def show_completions(step: int, owners: list[PromptItem], texts: list[str], total: torch.Tensor) -> None:
    """rl.log_completions: a few of this rank's (prompt, completion, reward) on the console, as TRL prints them."""
    for item, text, reward in list(zip(owners, texts, total.tolist()))[:SHOWN]:
        prompt = item.prompt if isinstance(item.prompt, str) else json.dumps(item.prompt, ensure_ascii=False)
        logger.info(f"step {step} completion (reward {reward:.4f}): {prompt!r} -> {text!r}")
