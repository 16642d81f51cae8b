"""GRPO's rollouts: the batches of one optimizer step, made from that step's prompts (rl/prompts.py).

Each rank samples rl.num_generations completions for each of its prompts with the policy as it is, sharded as it
trains (FSDP: the ranks generate in lockstep, inference/decode.py), completion j of the prompt at global index p
seeded from (job.seed, p x G + j): completions depend on neither the layout nor the batch. The reward functions
score them (titanlite/rewards/); the rewards of all ranks are gathered, so that every advantage (its group's or the
batch's statistics) is the one a single process computes. A completion is trained on as one row, the prompt then the
completion with its stop token, right-padded; its labels are the completion's tokens (all IGNORED when
rl.mask_truncated_completions leaves out a completion cut at max_new_tokens).

With rl.num_iterations above 1, the same rollouts serve that many optimizer steps, against the log-probabilities
of the policy that sampled them (computed once, before the first update); the rollouts and how many updates they
have served are the loader's state, so a resume inside them trains on the very same rows.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config_sections import RL
from titanlite.data.conversation_windows import IGNORED
from titanlite.data.packing import padded_width
from titanlite.rl.prompts import PromptItem, PromptOrder
from titanlite.inference.decode import Generated, Sampling, generate_ids
from titanlite.inference.prompts import completion_text
from titanlite.log import logger
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.rewards.functions import score
from titanlite.rl.grpo_loss import Normalizers, nanstd


@dataclass
class Rollouts:
    """This rank's rows of one rollout batch, with what their loss needs, and the batch's statistics."""

    inputs: torch.Tensor  # [n, W]
    labels: torch.Tensor  # [n, W], IGNORED outside the completions
    advantages: torch.Tensor  # [n]
    old_logps: torch.Tensor | None  # [n, W] under the sampling policy (num_iterations > 1), else None
    ref_logps: torch.Tensor | None  # [n, W] under the reference (beta > 0), else None
    norm: Normalizers
    stats: dict[str, float]  # rl/* of the whole batch

    def micro_batch(self, k: int, size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        rows = slice(k * size, (k + 1) * size)
        extras = {"advantages": self.advantages[rows], "norm": self.norm}
        for name in ("old_logps", "ref_logps"):
            if getattr(self, name) is not None:
                extras[name] = getattr(self, name)[rows]
        return self.inputs[rows], self.labels[rows], extras


def sample(run, items: list[PromptItem], rl: RL, seed: int) -> list[Generated]:
    """rl.num_generations completions of each prompt, in lockstep with the other ranks where there are any."""
    groups = rl.num_generations
    prompts = [item.ids for item in items for _ in range(groups)]
    indices = [item.index * groups + j for item in items for j in range(groups)]
    sampling = Sampling(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k, seed)
    model, was_training = run.model, run.model.training
    model.eval()  # dropout off; MoE's routing statistics count training forwards only
    try:
        # compile.enable compiles the blocks for training's shapes; a decode step per token through them would
        # recompile past dynamo's limit (every cache length is a new shape), so decoding runs them eagerly.
        with torch.compiler.set_stance("force_eager"):
            return generate_ids(model, run.args, run.tokenizer, prompts, sampling, indices=indices,
                                lockstep=dist.is_initialized() and dist.get_world_size() > 1)
    finally:
        model.train(was_training)


def sampled_ids(generated: Generated) -> list[int]:
    """The completion as sampled: its tokens and, where a stop token ended it, that token."""
    return generated.token_ids + ([generated.stop_token] if generated.finish_reason == "eos" else [])


def rows(prompts: list[list[int]], completions: list[list[int]], trained: list[bool], pad_id: int,
         seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [n, W]: prompt then completion, right-padded with pad_id; labels the completion's tokens where
    `trained`, W the longest row's (packing.py's padded_width)."""
    longest = max(len(p) + len(c) - 1 for p, c in zip(prompts, completions))
    width = padded_width(longest, seq_len)
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORED, dtype=torch.long)
    for row, (prompt, completion, train) in enumerate(zip(prompts, completions, trained)):
        sequence = torch.tensor(prompt + completion, dtype=torch.long)
        inputs[row, :len(sequence) - 1] = sequence[:-1]
        if train:
            labels[row, len(prompt) - 1:len(sequence) - 1] = sequence[len(prompt):]
    return inputs, labels


def gathered(values: torch.Tensor) -> torch.Tensor:
    """Every data-parallel rank's rows of `values`, in rank order (the global order of the completions)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts)


def batch_stats(per_function: torch.Tensor, total: torch.Tensor, zero_std: torch.Tensor, lengths: torch.Tensor,
                names: list[str], groups: int) -> dict[str, float]:
    """The rl/* statistics of the global batch (TRL's): the mean reward and each function's, the mean std of the
    groups' rewards, the share of groups whose rewards are all equal, the mean completion length."""
    stats = {"rl/reward": total.nanmean().item(), "rl/reward_std": nanstd(total.view(-1, groups), dim=1).nanmean().item(),
             "rl/frac_reward_zero_std": zero_std.float().mean().item(),
             "rl/completion_length": lengths.float().mean().item()}
    for name, column in zip(names, per_function.T):
        stats[f"rl/reward/{name}"] = column.nanmean().item()
    return stats


def number(value: float) -> float | None:
    """A reward as JSON has it: None where no function scored (NaN)."""
    return None if value != value else value


class RolloutLoader:
    """training.dataloader under GRPO: the micro-batches of each step, made from rollouts. `objective` is
    objectives/grpo.py's GRPO (its reward functions, its log-probabilities of the old policy and the reference)."""

    state_is_global = False  # the rollouts in use are this rank's own

    def __init__(self, run, order: PromptOrder, objective, accum_steps: int):
        self.run, self.order, self.objective, self.accum_steps = run, order, objective, accum_steps
        self.rl, self.size = run.cfg.rl, run.cfg.training.local_batch_size
        self.current: Rollouts | None = None
        self.served = 0  # optimizer steps the current rollouts have served
        self.log_path = Path(run.cfg.job.dump_folder) / "rollouts.jsonl" if self.rl.log_rollouts else None
        self.stats: list[dict[str, float]] = []  # the statistics of the rollouts each step since take_stats trained on

    def take_stats(self) -> list[dict[str, float]]:
        stats, self.stats = self.stats, []
        return stats

    def state_dict(self) -> dict:
        return {"order": self.order.state_dict(), "served": self.served, "rollouts": self.current}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state["order"])
        self.served, self.current = state["served"], state["rollouts"]

    def load_position(self, state: dict, saved_ranks: int) -> None:
        """A state saved on another number of data-parallel ranks: the prompts' position is global and resumes as it
        is; rollouts whose updates were not all done are rows of the old ranks, and the next step rolls out anew."""
        self.order.load_state_dict(state["order"])
        if state["rollouts"] is not None and state["served"] < self.rl.num_iterations:
            logger.warning(f"the checkpoint was saved by {saved_ranks} data-parallel ranks between the rl.num_iterations "
                           f"updates of one rollout batch ({state['served']} of {self.rl.num_iterations} done); its rollouts "
                           "are rows of those ranks, so the next step rolls out the next prompts")

    def __iter__(self):
        while True:
            if self.current is None or self.served == self.rl.num_iterations:
                self.current, self.served = self.roll_out(), 0
            self.served += 1  # counted before the step's batches are handed out: a save after the step sees it
            self.stats.append(self.current.stats)
            for k in range(self.accum_steps):
                yield self.current.micro_batch(k, self.size)

    def roll_out(self) -> Rollouts:
        run, rl, objective = self.run, self.rl, self.objective
        step = self.order.consumed // self.order.per_step * self.rl.num_iterations + 1  # the first step it serves
        items = self.order.next_step()
        began = time.perf_counter()
        with self.precision():
            generated = sample(run, items, rl, run.cfg.job.seed)
        generated_at = time.perf_counter()
        groups = rl.num_generations
        owners = [item for item in items for _ in range(groups)]  # each completion's prompt, in sample's order
        completions = [sampled_ids(g) for g in generated]
        prompts = [item.ids for item in owners]
        trained = [not (rl.mask_truncated_completions and g.finish_reason == "length") for g in generated]
        per_function, total = self.score(owners, generated, completions)
        scored_at = time.perf_counter()
        all_functions, all_total = gathered(per_function), gathered(total)
        advantages, zero_std = objective.advantages(all_total)
        n, rank = len(completions), self.order.dp_rank
        inputs, labels = rows(prompts, completions, trained, run.tokenizer.eos_id, run.cfg.training.seq_len)
        lengths = gathered(torch.tensor([len(c) for c in completions]))
        tokens = gathered(torch.tensor([int((labels != IGNORED).sum())])).sum().item()
        norm = Normalizers(completions=len(all_total), tokens=int(tokens),
                           max_completion_length=rl.max_new_tokens)
        stats = batch_stats(all_functions, all_total, zero_std, lengths, objective.reward_names, groups)
        local_advantages = advantages[rank * n:(rank + 1) * n]
        with self.precision():
            old, ref = objective.rollout_logps(run.model, inputs, labels, self.size)
        stats["rl/generate_seconds"], stats["rl/score_seconds"] = generated_at - began, scored_at - generated_at
        if self.log_path is not None:
            self.log(step, prompts, completions, per_function, total, local_advantages)
        return Rollouts(inputs, labels, local_advantages, old, ref, norm, stats)

    def precision(self):
        """The precision training computes in (autocast where FSDP does not cast): completions are sampled, and their
        old and reference log-probabilities computed, as the training forward will score them."""
        run = self.run
        return mixed_precision_context(run.dims, run.cfg.training.mixed_precision_param, run.device.type)

    def score(self, owners: list[PromptItem], generated: list[Generated],
              completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each function's rewards [n, F], NaN where one returned None; their weighted sum [n]) of this rank's
        completions; owners[i] is completion i's prompt."""
        texts = [completion_text(g.token_ids, self.run.tokenizer, ()) for g in generated]
        shown = [[{"role": "assistant", "content": text}] if isinstance(item.prompt, list) else text
                 for text, item in zip(texts, owners)]  # a chat prompt's completion as messages, as TRL passes it
        prompts = [item.prompt for item in owners]
        fields = {name: [item.fields[name] for item in owners] for name in owners[0].fields}
        return score(self.objective.reward_functions, self.objective.reward_weights, prompts, shown, completions, fields)

    def log(self, step: int, prompts, completions, per_function: torch.Tensor, total: torch.Tensor,
            advantages: torch.Tensor) -> None:
        """Every rank's completions of this rollout batch, one JSON line each, written by rank 0."""
        names = self.objective.reward_names
        lines = [json.dumps({"step": step, "prompt_ids": p, "completion_ids": c,
                             "rewards": {name: number(value) for name, value in zip(names, rewards)},
                             "reward": number(r), "advantage": a})
                 for p, c, rewards, r, a in zip(prompts, completions, per_function.tolist(), total.tolist(),
                                                advantages.tolist())]
        everyone = [None] * dist.get_world_size() if dist.is_initialized() else [lines]
        if dist.is_initialized():
            dist.all_gather_object(everyone, lines)
        if not dist.is_initialized() or dist.get_rank() == 0:
            with self.log_path.open("a") as out:
                out.writelines(line + "\n" for part in everyone for line in part)
