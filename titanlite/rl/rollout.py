"""GRPO's rollout stage: the micro-batches of each optimizer step, made from that step's prompts (rl/prompts.py).

Each rank has a RolloutEngine (rl/engine.py) sample rl.num_generations completions for each of its prompts,
completion j of the prompt at global index p seeded from (job.seed, p x G + j): completions depend on neither the
layout nor the batch. The reward functions score them (titanlite/rewards/); the rewards of all ranks are gathered, so
that every advantage (its group's or the batch's statistics) is the one a single process computes. A completion is
trained on as one row, the prompt then the completion with its stop token, right-padded; its labels are the
completion's tokens (all IGNORED when rl.mask_truncated_completions leaves out a completion cut at max_new_tokens).

With rl.num_iterations above 1, the same rollouts serve that many optimizer steps, against the log-probabilities
of the policy that sampled them (computed once, before the first update); the rollouts and how many updates they
have served are the stage's state, so a resume inside them trains on the very same rows.
"""

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config_sections import RL
from titanlite.data.batch import MicroBatch, Normalizers, RolloutTerms
from titanlite.errors import UserError
from titanlite.inference.decode import Sampling
from titanlite.inference.prompts import completion_text
from titanlite.log import logger
from titanlite.loss import IGNORED
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.rewards.loading import score
from titanlite.rl.ahead import Ahead
from titanlite.rl.engine import Completion, RolloutEngine, RolloutStopped
from titanlite.rl.episode import Agents, tool_stats
from titanlite.rl.grpo_loss import nanstd, token_logps
from titanlite.rl.log import RolloutLog, is_rank_zero, show_completions
from titanlite.rl.loss_family import aggregated_advantages
from titanlite.rl.prompts import PromptItem, PromptOrder
from titanlite.rl.rows import aligned_logprobs, masked_labels, rows


@dataclass(frozen=True)
class Rewards:
    """The reward functions (titanlite/rewards/), their names and weights."""

    functions: list
    names: list[str]
    weights: torch.Tensor


@dataclass
class Rollouts:
    """This rank's rows of one rollout batch, with what their loss needs, and the batch's statistics."""

    inputs: torch.Tensor  # [n, W]
    labels: torch.Tensor  # [n, W], IGNORED outside the completions
    terms: RolloutTerms
    stats: dict[str, float]  # rl/* of the whole batch

    def micro_batches(self, accum_steps: int, size: int) -> list[MicroBatch]:
        parts = [slice(k * size, (k + 1) * size) for k in range(accum_steps)]
        return [MicroBatch(self.inputs[p], self.labels[p], rollout=self.terms.rows(p)) for p in parts]


def gathered(values: torch.Tensor, sharing: int) -> torch.Tensor:
    """Every data-parallel rank's rows of `values`, in rank order (the global order of the completions): one of each
    `sharing` neighbouring ranks (a TP group, the mesh's innermost dimension, holds the same rows)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts[::sharing])


def batch_stats(
    per_function: torch.Tensor,
    total: torch.Tensor,
    zero_std: torch.Tensor,
    lengths: torch.Tensor,
    names: list[str],
    groups: int,
) -> dict[str, float]:
    """The rl/* statistics of the global batch (TRL's): the mean reward and each function's, the mean std of the
    groups' rewards, the share of groups whose rewards are all equal, the mean completion length."""
    stats = {
        "rl/reward": total.nanmean().item(),
        "rl/reward_std": nanstd(total.view(-1, groups), dim=1).nanmean().item(),
        "rl/frac_reward_zero_std": zero_std.float().mean().item(),
        "rl/completion_length": lengths.float().mean().item(),
    }
    for name, column in zip(names, per_function.T):
        stats[f"rl/reward/{name}"] = column.nanmean().item()
    return stats


def logps(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, size: int, temperature: float) -> torch.Tensor:
    """The labels' log-probabilities [n, W] under `model` at `temperature`, size rows at a time."""
    device = next(model.parameters()).device
    parts = []
    for start in range(0, len(inputs), size):
        logits = model(inputs[start : start + size].to(device))
        parts.append(token_logps(logits, labels[start : start + size].to(device).clamp(min=0), temperature)[0].cpu())
    return torch.cat(parts)


@torch.no_grad()
def rollout_logps(
    model: nn.Module, frozen, inputs: torch.Tensor, labels: torch.Tensor, size: int, rl: RL
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the sampling policy's log-probabilities where later updates need them, num_iterations > 1; the reference's,
    beta > 0, `frozen` objectives/reference.py's Reference), [n, W], computed size rows at a time before the first
    update."""
    old = ref = None
    if rl.num_iterations > 1:
        was_training = model.training
        model.eval()
        try:
            old = logps(model, inputs, labels, size, rl.temperature)
        finally:
            model.train(was_training)
    if frozen is not None:
        with frozen.of(model) as reference:
            ref = logps(reference, inputs, labels, size, rl.temperature)
    return old, ref


def any_rank(stopped: bool, device: torch.device) -> bool:
    """Whether a stop signal ended a decode on any rank (one flag all-reduced)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(stopped)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopped = bool(flag.item())
    return stopped


def every_rank_finished(generate: Callable[[], list[Completion]], device: torch.device) -> list[Completion]:
    """generate()'s completions where no rank was stopped by a signal meanwhile; else RolloutStopped on every rank
    (a rank the signal missed finishes its decode first)."""
    try:
        completions, stopped = generate(), False
    except RolloutStopped:
        completions, stopped = [], True
    if any_rank(stopped, device):
        raise RolloutStopped
    return completions


def say_what_trains_nothing(step: int, total: torch.Tensor, trained: int) -> None:
    """TRL's warnings: a batch no reward function scored, or whose completions are all masked, trains nothing."""
    if total.isnan().all():
        logger.warning(
            f"step {step}: every reward function returned None for every completion, so every advantage is 0 "
            "and the step trains nothing; check that the functions can score these prompts"
        )
    if trained == 0:
        logger.warning(
            f"step {step}: rl.mask_truncated_completions left out every completion (all were cut at "
            "rl.max_new_tokens), so the step trains nothing; raise rl.max_new_tokens"
        )


class RolloutStage:
    """training.dataloader under GRPO: each step's micro-batches and the statistics of their rollout batch, made from
    rollouts. It holds the prompt order, the engine, the rewards and the reference, not the objective."""

    state_is_global = False  # the rollouts in use are this rank's own

    def __init__(
        self, run, order: PromptOrder, engine: RolloutEngine, rewards: Rewards, frozen, agents: Agents | None = None
    ):
        self.run, self.order, self.engine, self.rewards, self.frozen = run, order, engine, rewards, frozen
        self.agents = agents  # rl.tools / rl.environment: multi-turn episodes (rl/episode.py)
        self.rl, self.size = run.cfg.rl, run.cfg.training.local_batch_size
        self.accum_steps = run.step.accum_steps
        self.current: Rollouts | None = None
        self.served = 0  # optimizer steps the current rollouts have served
        self.log = (
            RolloutLog.at(run.cfg.job.dump_folder, run.dims.batch_sharing_degree) if self.rl.log_rollouts else None
        )
        self.ahead = Ahead(self.rl.max_staleness) if self.rl.max_staleness else None
        self.trained = 0  # steps handed their batches (rl.max_staleness >= 1)

    def state_dict(self) -> dict:
        state = {"order": self.order.state_dict(), "served": self.served, "rollouts": self.current}
        if self.ahead is not None:
            try:
                self.land(float("inf"))  # the rollouts in flight are saved as completions
            except RolloutStopped:  # a save on a stop signal: those in flight were dropped, their prompts put back
                pass
            state |= {"order": self.order.state_dict(), "ahead": self.ahead.state_dict(), "trained": self.trained}
        return state

    def load_state_dict(self, state: dict) -> None:
        staleness = state["ahead"]["staleness"] if "ahead" in state else 0
        if staleness != self.rl.max_staleness:
            raise UserError(
                f"the checkpoint's rollouts were sampled at rl.max_staleness {staleness}, which sets which "
                f"weights sample each step; resume with rl.max_staleness {staleness}"
            )
        self.order.load_state_dict(state["order"])
        self.served, self.current = state["served"], state["rollouts"]
        if self.ahead is not None:
            self.ahead.load_state_dict(state["ahead"])
            self.trained = state["trained"]

    def load_position(self, state: dict, saved_ranks: int) -> None:
        """A state saved on another number of data-parallel ranks: the prompts' position is global and resumes as it
        is; rollouts whose updates were not all done are rows of the old ranks, and the next step rolls out anew.
        Rollouts sampled ahead (rl.max_staleness) are the old ranks' too, and their prompts are already counted."""
        if "ahead" in state:
            raise UserError(
                f"the checkpoint was saved by {saved_ranks} data-parallel ranks with rollouts sampled ahead "
                "(rl.max_staleness), which belong to those ranks; resume on the same number of ranks"
            )
        self.order.load_state_dict(state["order"])
        if state["rollouts"] is not None and state["served"] < self.rl.num_iterations:
            logger.warning(
                f"the checkpoint was saved by {saved_ranks} data-parallel ranks between the rl.num_iterations "
                f"updates of one rollout batch ({state['served']} of {self.rl.num_iterations} done); its rollouts "
                "are rows of those ranks, so the next step rolls out the next prompts"
            )

    def __iter__(self):
        while True:
            if self.ahead is not None:  # one update per rollout batch, sampled ahead (rl/ahead.py)
                self.current = self.stale_rollouts(self.trained + 1)
                self.trained += 1
            elif self.current is None or self.served == self.rl.num_iterations:
                self.current, self.served = self.roll_out(), 0
            self.served += 1  # counted before the step's batches are handed out: a save after the step sees it
            yield self.current.micro_batches(self.accum_steps, self.size), self.current.stats

    def request(self, items: list[PromptItem]) -> tuple[list[list[int]], Sampling, list[int]]:
        """(the prompts, the sampling, each completion's seed index) of rl.num_generations completions per item."""
        rl, groups = self.rl, self.rl.num_generations
        prompts = [item.ids for item in items for _ in range(groups)]
        indices = [item.index * groups + j for item in items for j in range(groups)]
        return prompts, Sampling(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k, self.run.cfg.job.seed), indices

    def stale_rollouts(self, step: int) -> Rollouts:
        """Step `step`'s rollouts, sampled ahead; the steps up to step + K not yet handed to the engine are, with the
        weights after step - 1 (at a fresh start, steps 1 .. K + 1, with the initial weights)."""
        self.engine.update_weights(step - 1)
        # none past training.steps, which nothing would train on (a resume with more steps samples those late)
        for target in (s for s in self.ahead.missing(step) if s <= self.run.cfg.training.steps):
            position = self.order.state_dict()
            items = self.order.next_step()
            self.ahead.launch(target, items, self.submit(items), position)
        began = time.perf_counter()
        self.land(step)
        sampled = self.ahead.done.pop(step)
        return self.made(step, sampled.items, sampled.completions, sampled.seconds, time.perf_counter() - began)

    def submit(self, items: list[PromptItem]) -> Future:
        """The items' completions, or agents' episodes (their turns and tool calls on the engine's thread), sampled in
        the background by the weights of now."""
        if self.agents is None:
            return self.engine.submit(*self.request(items))
        _, sampling, indices = self.request(items)
        groups, agents = self.rl.num_generations, self.agents
        return self.engine.submit_turns(lambda generate: agents.episodes(generate, items, groups, sampling, indices))

    def land(self, upto: float) -> None:
        """The batches in flight up to step `upto` finished; where a stop signal ended one on any rank, every batch
        in flight is dropped, the prompt order is put back before them, and RolloutStopped is raised."""
        if not any_rank(self.ahead.land(upto), self.run.device):
            return
        position = self.ahead.drop_flights()
        if position is not None:
            self.order.load_state_dict(position)
        raise RolloutStopped

    def stop_when(self, stopping: Callable[[], bool]) -> None:
        """A rollout stops at the next decoded token once `stopping()` (the trainer's stop signal), not at its end."""
        self.engine.stopping = stopping

    def roll_out(self) -> Rollouts:
        step = self.order.consumed // self.order.per_step * self.rl.num_iterations + 1  # the first step it serves
        position = self.order.state_dict()
        items = self.order.next_step()
        began = time.perf_counter()
        self.engine.update_weights(step - 1)

        def generate() -> list[Completion]:
            if self.agents is not None:
                return self.agents.roll_out(self.engine, items, self.rl.num_generations, *self.request(items)[1:])
            return self.engine.generate(*self.request(items))

        try:
            with self.precision():
                completions = every_rank_finished(generate, self.run.device)
        except RolloutStopped:
            self.order.load_state_dict(position)  # its prompts are the next rollout's again: a save after it sees them
            raise
        seconds = time.perf_counter() - began
        return self.made(step, items, completions, seconds, seconds)

    def made(
        self, step: int, items: list[PromptItem], completions: list[Completion], generate_seconds: float, waited: float
    ) -> Rollouts:
        """The rollouts of step's completions: scored, their advantages, rows and log-probabilities; `waited`: the
        seconds the step waited for the completions (generate_seconds, unless they were sampled ahead)."""
        run, rl, rewards = self.run, self.rl, self.rewards
        began = time.perf_counter()
        groups = rl.num_generations
        owners = [item for item in items for _ in range(groups)]  # each completion's prompt, in sample's order
        sampled = [c.sampled_ids for c in completions]
        prompts = [c.prompt_ids if self.agents else item.ids for item, c in zip(owners, completions)]
        trained = [not (rl.mask_truncated_completions and c.finish_reason == "length") for c in completions]
        texts = [completion_text(c.ids, run.tokenizer, ()) for c in completions]
        per_function, total = self.score(owners, texts, sampled, completions)
        score_seconds = time.perf_counter() - began
        sharing = run.dims.batch_sharing_degree
        all_functions, all_total = gathered(per_function, sharing), gathered(total, sharing)
        advantages, zero_std = aggregated_advantages(
            all_functions, rewards.weights, groups, rl.scale_rewards, rl.multi_objective_aggregation
        )
        n, rank = len(sampled), self.order.dp_rank
        inputs, labels = rows(prompts, sampled, trained, run.tokenizer.eos_id, run.cfg.training.seq_len)
        if self.agents is not None:  # the tokens the template and the tools inserted are never labels
            labels = masked_labels(labels, prompts, completions)
        lengths = gathered(torch.tensor([len(c) for c in sampled]), sharing)
        tokens = int(gathered(torch.tensor([int((labels != IGNORED).sum())]), sharing).sum().item())
        say_what_trains_nothing(step, all_total, tokens)
        norm = Normalizers(completions=len(all_total), tokens=tokens, max_completion_length=rl.max_new_tokens)
        stats = batch_stats(all_functions, all_total, zero_std, lengths, rewards.names, groups)
        local_advantages = advantages[rank * n : (rank + 1) * n]
        with self.precision():
            old, ref = rollout_logps(run.model, self.frozen, inputs, labels, self.size, rl)
        stats["rl/generate_seconds"], stats["rl/score_seconds"] = generate_seconds, score_seconds
        if self.agents is not None:
            stats |= tool_stats(completions)
        if self.ahead is not None:
            stats["rl/generate_wait_seconds"] = waited
        if self.log is not None:
            self.log.write(step, owners, completions, texts, rewards.names, per_function, total, local_advantages)
        if rl.log_completions and is_rank_zero() and self.logs_a_step(step):
            show_completions(step, owners, texts, total)
        corrects = rl.importance_sampling != "none" or rl.off_policy_mask_threshold != -1
        sampler = aligned_logprobs(prompts, completions, inputs.shape[1]) if corrects else None
        return Rollouts(inputs, labels, RolloutTerms(local_advantages, norm, old, ref, sampler), stats)

    def logs_a_step(self, step: int) -> bool:
        """Whether one of the steps these rollouts serve writes the step line (metrics.log_freq)."""
        return any(s == 1 or s % self.run.cfg.metrics.log_freq == 0 for s in range(step, step + self.rl.num_iterations))

    def precision(self):
        """The precision training computes in (autocast where FSDP does not cast): completions are sampled, and their
        old and reference log-probabilities computed, as the training forward will score them."""
        run = self.run
        return mixed_precision_context(run.dims, run.cfg.training.mixed_precision_param, run.device.type)

    def score(
        self, owners: list[PromptItem], texts: list[str], completions: list[list[int]], sampled: list[Completion]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each function's rewards [n, F], NaN where one returned None; their weighted sum [n]) of this rank's
        completions; owners[i] is completion i's prompt."""
        shown = [
            [{"role": "assistant", "content": text}] if isinstance(item.prompt, list) else text
            for text, item in zip(texts, owners)
        ]  # a chat prompt's completion as messages, as TRL passes it
        prompts = [item.prompt for item in owners]
        fields = {name: [item.fields[name] for item in owners] for name in owners[0].fields}
        if self.agents is not None:  # an episode's messages (assistant, tool, ...) and environments, as TRL passes them
            shown = [episode.messages for episode in sampled]
            if self.agents.tools.environment is not None:
                fields["environments"] = [episode.environment for episode in sampled]
        return score(self.rewards.functions, self.rewards.weights, prompts, shown, completions, fields)
