"""Group relative policy optimization with verifiable rewards (training.dataset_format prompts, the [rl] section).

Each step's micro-batches are rollouts (rl/rollout.py): completions the policy sampled for the step's prompts,
scored by the reward functions (titanlite/rewards/), each with its advantage. A micro-batch's loss is its share of
the loss of the whole global batch (rl/grpo_loss.py: the token losses clipped as PPO clips them, plus beta x the k3
KL to the reference, reduced as rl.loss_type says), so the step's loss and gradients are those of one process
holding every completion, whatever the layout and accumulation. Log-probabilities are those of the logits divided
by rl.temperature, the distribution the completions were sampled from, as TRL computes them.
"""

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config_sections import JobConfig
from titanlite.data.conversation_windows import IGNORED
from titanlite.errors import UserError
from titanlite.objectives.reference import Reference, needs_copy
from titanlite.rewards.functions import load_reward_functions, reward_weights
from titanlite.rl.grpo_loss import group_advantages, per_token_loss, reduce_loss, token_logps
from titanlite.rl.prompts import PromptOrder, PromptSet
from titanlite.rl.rollout import RolloutLoader

# Summed over the steps since the last log, then all-reduced: completion tokens, their entropy, clipped ones, KL.
TOKEN_SUMS = ("tokens", "entropy", "clipped", "kl")


class GRPO:
    """The GRPO loss of a micro-batch of rollouts, its data (the rollout loader), reference and rl/* scalars."""

    name = "grpo"
    rows_per_example = 1  # a row is one completion after its prompt
    loss_weighting = "share"  # loss() gives the micro-batch's share of the global batch's loss (the step undoes FSDP's mean)
    rows_may_pack = False  # one prompt and completion per row: a bos the policy sampled starts no document
    resets_positions = False  # one sequence per row, from position 0
    runs_reference_forward = False  # the planner's count: rl.beta's reference forward is once per rollout, said there

    @classmethod
    def needs_reference_copy(cls, cfg: JobConfig) -> bool:
        return cfg.rl.beta > 0 and needs_copy(cfg.rl.reference, cfg)

    @classmethod
    def plan_note(cls, cfg: JobConfig) -> str:
        """What the planner leaves out of a GRPO step: making its rollouts."""
        rl = cfg.rl
        forwards = " and ".join(part for part, on in (("the old policy's", rl.num_iterations > 1),
                                                      ("the reference's", rl.beta > 0)) if on)
        extra = f", {forwards} forward over them" if forwards else ""
        return (f"a GRPO step is counted as its training forward and backward only: generating its rollouts "
                f"({rl.num_generations} completions of up to {rl.max_new_tokens} tokens per prompt, one decode step per "
                f"token, with a KV cache left out of the memory rows){extra} and scoring them come on top (the run logs "
                "rl/generate_seconds)")

    @classmethod
    def build(cls, cfg: JobConfig, copy: Callable[[], nn.Module], hf_adapter, args, label: str,
              device: torch.device) -> "GRPO":
        frozen = (Reference.build(cfg.rl.reference, "rl.reference", cfg, copy, hf_adapter, args, label, "GRPO")
                  if cfg.rl.beta > 0 else None)
        return cls(cfg, frozen, device)

    def __init__(self, cfg: JobConfig, frozen: Reference | None, device: torch.device):
        self.rl, self.frozen = cfg.rl, frozen
        self.reference = frozen.model if frozen is not None else None
        self.reward_functions = load_reward_functions(cfg.rl.reward_functions, "rl.reward_functions")
        self.reward_names = [function.name for function in self.reward_functions]
        self.reward_weights = reward_weights(cfg.rl.reward_weights, len(self.reward_functions))
        self.sums = torch.zeros(len(TOKEN_SUMS), device=device, dtype=torch.float64)
        self.loader: RolloutLoader | None = None

    def dataloader(self, run, dp_rank: int, dp_world: int) -> RolloutLoader:
        """The step's micro-batches, made from the prompts at training.dataset_path."""
        cfg = run.cfg
        prompts = PromptSet(cfg.training.dataset_path, run.tokenizer, cfg.training.chat_template)
        longest = max(map(len, prompts.ids))
        if longest + self.rl.max_new_tokens > cfg.training.seq_len + 1:
            raise UserError(f"the longest prompt ({longest} tokens) and rl.max_new_tokens {self.rl.max_new_tokens} pass "
                            f"training.seq_len {cfg.training.seq_len} + 1; raise training.seq_len or lower rl.max_new_tokens")
        per_step = cfg.training.global_batch_size // self.rl.num_generations
        identity = {"prompts": cfg.training.dataset_path, "seed": cfg.job.seed, "num_generations": self.rl.num_generations}
        order = PromptOrder(prompts, per_step, dp_rank, dp_world, cfg.job.seed, identity)
        self.loader = RolloutLoader(run, order, self, run.step.accum_steps)
        return self.loader

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return group_advantages(rewards, self.rl.num_generations, self.rl.scale_rewards)

    @torch.no_grad()
    def rollout_logps(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                      size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the sampling policy's log-probabilities where later updates need them, num_iterations > 1; the
        reference's, beta > 0), [n, W], computed size rows at a time before the first update."""
        old = ref = None
        if self.rl.num_iterations > 1:
            was_training = model.training
            model.eval()
            try:
                old = self.logps(model, inputs, labels, size)
            finally:
                model.train(was_training)
        if self.frozen is not None:
            with self.frozen.of(model) as reference:
                ref = self.logps(reference, inputs, labels, size)
        return old, ref

    def logps(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, size: int) -> torch.Tensor:
        device = next(model.parameters()).device
        parts = []
        for start in range(0, len(inputs), size):
            logits = model(inputs[start:start + size].to(device))
            parts.append(token_logps(logits, labels[start:start + size].to(device).clamp(min=0), self.rl.temperature)[0].cpu())
        return torch.cat(parts)

    def loss(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, loss_fn,
             forward_context: Callable, extras: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the micro-batch's share of the step's GRPO loss, the policy forward's extra losses)."""
        with forward_context():
            logits, extra = model(inputs, extra_losses=True, **model_kwargs)
        mask = labels != IGNORED
        logps, entropy = token_logps(logits, labels.clamp(min=0), self.rl.temperature)
        device = logps.device
        old = extras["old_logps"].to(device) if "old_logps" in extras else logps.detach()
        ref = extras["ref_logps"].to(device) if "ref_logps" in extras else None
        epsilon_high = self.rl.epsilon if self.rl.epsilon_high == -1 else self.rl.epsilon_high
        per_token, stats = per_token_loss(logps, old, extras["advantages"].to(device), self.rl.epsilon, epsilon_high,
                                          self.rl.beta, ref)
        with torch.no_grad():
            kl = stats.kl[mask].sum() if stats.kl is not None else torch.zeros((), device=device)
            self.sums += torch.stack([mask.sum(), entropy[mask].sum(), stats.region_clipped[mask].sum(), kl]).double()
        return reduce_loss(per_token, mask, self.rl.loss_type, extras["norm"]), extra

    def scalars(self) -> dict[str, float]:
        """The rl/* means since the last call: the rollouts' (their whole batches) and the trained tokens' (over all
        ranks: a collective, every rank calls it)."""
        sums = self.sums.clone()
        dist.all_reduce(sums)
        self.sums.zero_()
        tokens, entropy, clipped, kl = sums.tolist()
        values = {"rl/entropy": entropy / max(tokens, 1), "rl/clip_ratio": clipped / max(tokens, 1)}
        if self.rl.beta > 0:
            values["rl/kl"] = kl / max(tokens, 1)
        stats = self.loader.take_stats() if self.loader is not None else []
        for name in (stats[0] if stats else {}):
            values[name] = sum(s[name] for s in stats) / len(stats)
        return values
