"""Group relative policy optimization with verifiable rewards (training.dataset_format prompts, the [rl] section).

Each step's micro-batches are rollouts made by the rollout stage (rl/rollout.py: a RolloutEngine samples completions
for the step's prompts, the reward functions of titanlite/rewards/ score them, each gets its advantage); this
objective builds that stage from its parts and keeps no reference to it. A micro-batch's loss is its share of the
loss of the whole global batch (rl/loss_family.py: TRL 1.16's token losses of rl.loss_type, plus beta x the k3 KL
to the reference, reduced as rl.loss_type says), so the step's loss and gradients are those of one process holding every
completion, whatever the layout and accumulation. Log-probabilities are those of the logits divided by
rl.temperature, the distribution the completions were sampled from, as TRL computes them; rl.importance_sampling and
rl.off_policy_mask_threshold weight the surrogate by the trainer/sampler ratio (rl/off_policy.py).
"""

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.data.batch import MicroBatch, RolloutTerms
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.loss import IGNORED
from titanlite.objectives.reference import Reference, needs_copy
from titanlite.rewards.loading import reward_weights
from titanlite.rl.engine import ColocatedEngine
from titanlite.rl.episode import Agents, Tools
from titanlite.rl.generator import GeneratorEngine, GeneratorStage
from titanlite.rl.grpo_loss import token_logps
from titanlite.rl.loss_family import (
    LossSettings,
    check_loss_settings,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    kept_entropies,
    per_token_loss,
    reduce_loss,
)
from titanlite.rl.off_policy import importance_ratio, off_policy_mask
from titanlite.rl.prompts import PromptOrder, PromptSet
from titanlite.rl.rollout import Rewards, RolloutStage

# Summed over the steps since the last log, then all-reduced: completion tokens, their entropy, clipped ones, KL, and
# under rl.importance_sampling the ratio's sum (over tokens, or completions for sequence_*), its count, the
# sampler - trainer log-ratio's sum (the KL of the trainer to the sampler, over tokens).
TOKEN_SUMS = ("tokens", "entropy", "clipped", "kl", "ratio", "ratios", "sampling_kl")


class GRPO:
    """The GRPO loss of a micro-batch of rollouts, its data (the rollout loader), reference and rl/* scalars."""

    name = "grpo"
    rows_per_example = 1  # a row is one completion after its prompt
    loss_weighting = (
        "share"  # loss() gives the micro-batch's share of the global batch's loss (the step undoes FSDP's mean)
    )
    rows_may_pack = False  # one prompt and completion per row: a bos the policy sampled starts no document
    resets_positions = False  # one sequence per row, from position 0
    runs_reference_forward = False  # the planner's count: rl.beta's reference forward is once per rollout, said there
    generates = True  # its batches are rollouts, timed as rl/generate_seconds and rl/score_seconds

    @classmethod
    def needs_reference_copy(cls, cfg: JobConfig) -> bool:
        return cfg.rl.beta > 0 and needs_copy(cfg.rl.reference, cfg)

    @classmethod
    def plan_note(cls, cfg: JobConfig) -> str:
        """How the planner counts a GRPO step's rollout (plan/rollout.py)."""
        return (
            "a GRPO step's rollout is counted as its gathered weights, KV cache and logits in memory and a "
            "memory-bound decode of rl.max_new_tokens steps in time; prefill and scoring are left out (the run "
            "logs rl/generate_seconds and rl/score_seconds)"
        )

    @classmethod
    def build(
        cls, cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str, device: torch.device
    ) -> "GRPO":
        frozen = (
            Reference.build(cfg.rl.reference, "rl.reference", cfg, copy, hf_adapter, args, label, "GRPO")
            if cfg.rl.beta > 0
            else None
        )
        return cls(cfg, frozen, device)

    def __init__(self, cfg: JobConfig, frozen: Reference | None, device: torch.device):
        self.rl, self.frozen = cfg.rl, frozen
        self.reference = frozen.model if frozen is not None else None
        self.tools = Tools(cfg.rl)  # rl.tools and rl.environment, checked now (rl/episode.py)
        functions = self.tools.rewards()
        self.rewards = Rewards(
            functions, [function.name for function in functions], reward_weights(cfg.rl.reward_weights, len(functions))
        )
        self.sums = torch.zeros(len(TOKEN_SUMS), device=device, dtype=torch.float64)
        self.extremes = torch.tensor([float("inf"), float("inf")], device=device, dtype=torch.float64)  # -max, min
        self.batch_stats: list[dict[str, float]] = []  # each trained step's rollout batch's, since the last scalars()
        self.settings = loss_settings(cfg.rl)
        for warning in check_loss_settings(self.settings):
            logger.warning(warning)
        self.sharing = 1  # neighbouring ranks holding the same rows (a TP group), known once the stage is built
        self.step_rows: list[MicroBatch] | None = None  # the step's micro-batches, until its entropy threshold is taken
        self.threshold: tuple[torch.Tensor, int] | None = None  # rl.top_entropy_quantile's, and the tokens it keeps

    def dataloader(self, run, dp_rank: int, dp_world: int) -> RolloutStage:
        """The step's micro-batches, made from the prompts at training.dataset_path."""
        cfg = run.cfg
        prompts = PromptSet(cfg.training.dataset_path, run.tokenizer, cfg.training.chat_template)
        longest = max(map(len, prompts.ids))
        if longest + self.rl.max_new_tokens > cfg.training.seq_len + 1:
            raise UserError(
                f"the longest prompt ({longest} tokens) and rl.max_new_tokens {self.rl.max_new_tokens} pass "
                f"training.seq_len {cfg.training.seq_len} + 1; raise training.seq_len or lower rl.max_new_tokens"
            )
        per_step = cfg.training.global_batch_size // self.rl.num_generations
        identity = {
            "prompts": cfg.training.dataset_path,
            "seed": cfg.job.seed,
            "num_generations": self.rl.num_generations,
        }
        order = PromptOrder(prompts, per_step, dp_rank, dp_world, cfg.job.seed, identity)
        self.sharing = run.dims.batch_sharing_degree
        agents = (
            Agents(self.tools, run.tokenizer, cfg.training.chat_template, cfg.training.seq_len)
            if self.tools.enabled
            else None
        )
        if agents is not None:
            agents.check_prompts(prompts.prompts)
        if run.info.generators is not None:  # rl.generator_ranks
            return GeneratorStage(run, order, GeneratorEngine(run), self.rewards, self.frozen, agents)
        return RolloutStage(run, order, ColocatedEngine(run), self.rewards, self.frozen, agents)

    def step_batches(self, batches: Iterator, accum_steps: int) -> list[MicroBatch]:
        """The step's micro-batches of the rollout stage, whose batch statistics the next scalars() reports."""
        micro_batches, stats = next(batches)
        self.batch_stats.append(stats)
        if self.settings.top_entropy_quantile < 1:
            self.step_rows, self.threshold = micro_batches, None
        return micro_batches

    def loss(
        self, model: nn.Module, batch: MicroBatch, model_kwargs: dict, loss_fn, forward_context: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the micro-batch's share of the step's GRPO loss, the policy forward's extra losses)."""
        threshold = self.entropy_threshold(model, forward_context) if self.settings.top_entropy_quantile < 1 else None
        with forward_context():
            logits, extra = model(batch.inputs, extra_losses=True, **model_kwargs)
        labels, terms = batch.labels, batch.rollout
        mask = labels != IGNORED
        logps, entropy = token_logps(logits, labels.clamp(min=0), self.rl.temperature)
        device = logps.device
        old = terms.old_logps.to(device) if terms.old_logps is not None else logps.detach()
        ref = terms.ref_logps.to(device) if terms.ref_logps is not None else None
        advantages, norm = terms.advantages.to(device), terms.norm
        off_policy, ratio = self.correction(terms, logps, old, advantages, mask)
        keep = None
        if threshold is not None:
            keep = high_entropy_mask(entropy, mask, threshold[0])
            norm = dataclasses.replace(norm, entropy_tokens=threshold[1])
        per_token, stats = per_token_loss(
            logps,
            old,
            advantages,
            mask,
            self.settings,
            ref_logps=ref,
            entropy_mask=keep,
            sampling_ratio=ratio,
            off_policy_mask=off_policy,
        )
        with torch.no_grad():
            kl = stats.kl[mask].sum() if stats.kl is not None else torch.zeros((), device=device)
            self.sums[:4] += torch.stack(
                [mask.sum(), entropy[mask].sum(), stats.region_clipped[mask].sum(), kl]
            ).double()
        loss = reduce_loss(per_token, mask, self.settings.loss_type, norm)
        if self.settings.entropy_coef:
            loss = loss + entropy_bonus(entropy, mask, keep, self.settings.entropy_coef, norm)
        return loss, extra

    @torch.no_grad()
    def entropy_threshold(self, model: nn.Module, forward_context: Callable) -> tuple[torch.Tensor, int]:
        """(rl.top_entropy_quantile's entropy threshold of the step, the global batch's tokens at or above it), taken
        once per step, before its first update, from a forward without gradient over this rank's rows gathered with
        every other rank's (rl/loss_family.py): one threshold for the step, as one process holding the batch has.
        A GRPO row is one sequence from position 0: its forward needs no keyword inputs."""
        if self.threshold is None:
            entropies = []
            for rows in self.step_rows:
                with forward_context():
                    logits = model(rows.inputs.to(next(model.parameters()).device))
                labels = rows.labels.to(logits.device)
                entropy = token_logps(logits, labels.clamp(min=0), self.rl.temperature)[1]
                entropies.append(kept_entropies(entropy, labels != IGNORED, self.sharing))
            self.threshold = entropy_threshold(torch.cat(entropies), self.settings.top_entropy_quantile)
            self.step_rows = None
        return self.threshold

    @torch.no_grad()
    def correction(
        self, terms: RolloutTerms, logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the off-policy sequence mask [B, 1], the importance-sampling ratio [B, T] or [B, 1]) of rl/off_policy.py,
        each None where it is not asked for; the ratio's statistics are added to the sums."""
        rl, kept, ratio = self.rl, None, None
        if terms.sampler_logps is None:
            return None, None
        sampler, float_mask = terms.sampler_logps.to(logps.device), mask.float()
        if rl.off_policy_mask_threshold != -1:
            kept = off_policy_mask(advantages, logps, sampler, float_mask, rl.off_policy_mask_threshold)
        if rl.importance_sampling != "none":
            ratio = importance_ratio(
                old,
                sampler,
                float_mask,
                rl.importance_sampling,
                clip(rl.importance_sampling_clip_min),
                clip(rl.importance_sampling_clip_max),
            )
            counted = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask]
            self.sums[4:] += torch.stack(
                [
                    counted.sum(),
                    torch.tensor(float(counted.numel()), device=ratio.device),
                    ((sampler - old) * float_mask).sum(),
                ]
            ).double()
            if counted.numel():
                self.extremes = torch.minimum(self.extremes, torch.stack([-counted.max(), counted.min()]).double())
        return kept, ratio

    def scalars(self) -> dict[str, float]:
        """The rl/* means since the last call: the rollouts' (their whole batches) and the trained tokens' (over all
        ranks: a collective, every rank calls it)."""
        sums, extremes = self.sums.clone(), self.extremes.clone()
        dist.all_reduce(sums)
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        self.sums.zero_()
        self.extremes.fill_(float("inf"))
        tokens, entropy, clipped, kl, ratio, ratios, sampling_kl = sums.tolist()
        values = {"rl/entropy": entropy / max(tokens, 1), "rl/clip_ratio": clipped / max(tokens, 1)}
        if self.rl.beta > 0:
            values["rl/kl"] = kl / max(tokens, 1)
        if self.rl.importance_sampling != "none" and ratios:
            values |= {
                "rl/sampling/ratio_mean": ratio / ratios,
                "rl/sampling/ratio_min": extremes[1].item(),
                "rl/sampling/ratio_max": -extremes[0].item(),
                "rl/sampling/kl": sampling_kl / max(tokens, 1),
            }
        stats, self.batch_stats = self.batch_stats, []
        for name in stats[0] if stats else {}:
            values[name] = sum(s[name] for s in stats) / len(stats)
        return values


def loss_settings(rl) -> LossSettings:
    """The [rl] keys the loss reads; epsilon_high -1 is epsilon."""
    names = [f.name for f in dataclasses.fields(LossSettings) if f.name not in ("epsilon_low", "epsilon_high")]
    high = rl.epsilon if rl.epsilon_high == -1 else rl.epsilon_high
    return LossSettings(epsilon_low=rl.epsilon, epsilon_high=high, **{name: getattr(rl, name) for name in names})


def clip(value: float) -> float | None:
    """A clip bound of [rl]: -1 is off."""
    return None if value == -1 else value
