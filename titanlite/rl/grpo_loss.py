"""GRPO's math as plain tensor functions, with TRL 1.16's meanings (GRPOTrainer's _generate_and_score_completions
for the advantages, _compute_loss for the loss); docs/grpo.md has the formulas.

    group_advantages   the global batch's rewards -> each completion's advantage (and whether its std was zero)
    token_logps        logits -> the targets' log-probs and the entropy, of logits / temperature
    per_token_loss     the clipped surrogate + beta x ratio x k3 KL per token, and the clip indicators
    reduce_loss        a micro-batch's share of the step's loss, normalised by the GLOBAL batch's counts, so that
                       the shares of every micro-batch on every data-parallel rank add up to the loss one process
                       computes over the whole batch (2 ranks = 1 process, any accumulation = none)
"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from titanlite.data.batch import Normalizers

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
STD_EPS = 1e-4  # TRL's: (reward - mean) / (std + 1e-4)
CHUNK_ELEMENTS = 2**24  # logits upcast to fp32 this many at a time (64 MiB)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's nanstd: torch.std where nothing is NaN, NaN where
    fewer than two values are not)."""
    keep = dict(dim=dim, keepdim=True) if dim is not None else {}
    mean = torch.nanmean(x, **keep)
    count = (~torch.isnan(x)).sum(**keep)
    variance = torch.nanmean((x - mean) ** 2, **keep) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    return variance.sqrt().squeeze(dim) if dim is not None else variance.sqrt()


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(each completion's advantage [N], whether the std that scales it is zero [N] bool, TRL's is_std_zero behind
    rl/frac_reward_zero_std). rewards [N] is the whole global batch, completion i of prompt i // num_generations,
    already summed over the reward functions; NaN marks a completion no function scored (TRL: every function
    returned None): it is left out of its group's mean and std and its advantage is 0.

    The advantage is the reward minus its group's mean, divided by (std + 1e-4) with the group's std ("group") or
    the whole batch's ("batch"), or not divided ("none"); zero_std reads the group's std for "group" and "none", the
    batch's for "batch", as TRL does."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards is {scale_rewards!r}; use one of {', '.join(SCALE_REWARDS)}.")
    if rewards.dim() != 1 or len(rewards) % num_generations:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; it must be [N] with N a multiple of "
                         f"num_generations ({num_generations}).")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if len(rewards) > 1 else torch.zeros_like(rewards)
    else:
        std = (nanstd(groups, dim=1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def _chunks(logits: torch.Tensor):
    """(row, positions) pieces of logits [B, T, V] of about CHUNK_ELEMENTS each: views, even of a sliced tensor."""
    positions = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    for row in range(logits.shape[0]):
        for start in range(0, logits.shape[1], positions):
            yield row, slice(start, start + positions)


class _TokenLogps(torch.autograd.Function):
    """log_softmax(logits / temperature) at the targets, and the entropy of that distribution, a chunk at a time:
    no fp32 copy of all the logits is made or kept for backward (only each position's logsumexp is), and the
    backward recomputes each chunk's softmax. The entropy is a statistic: it carries no gradient."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        lse = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        logps, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for row, part in _chunks(logits):
            x = logits[row, part].float() / temperature
            lse[row, part] = torch.logsumexp(x, dim=-1)
            logps[row, part] = x.gather(-1, targets[row, part, None]).squeeze(-1) - lse[row, part]
            # H = lse - sum_v p_v x_v, the expectation computed in place of x's copy
            entropy[row, part] = lse[row, part] - x.mul_(torch.softmax(x, dim=-1)).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for row, part in _chunks(logits):
            # d logp_t / d logit_v = (onehot_t(v) - p_v) / temperature
            p = (logits[row, part].float() / ctx.temperature).sub_(lse[row, part, None]).exp_()
            scale = grad_logps[row, part, None] / ctx.temperature
            g = p.mul_(-scale)
            g.scatter_add_(-1, targets[row, part, None], scale)
            grad[row, part] = g
        return grad, None, None


def token_logps(logits: torch.Tensor, targets: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of targets [B, T] fp32, entropy [B, T] fp32, no gradient) under softmax(logits / temperature),
    logits [B, T, V] in any float dtype, as TRL scores completions (it divides by the sampling temperature too).
    Every target must be a vocabulary id: a masked position's value is meaningless and reduce_loss drops it.
    Logits that are vocab-sharded DTensors (TP's loss parallel) are gathered whole first."""
    if temperature <= 0:
        raise ValueError(f"temperature is {temperature}; it must be positive.")
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return _TokenLogps.apply(logits, targets, float(temperature))


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of per_token_loss, for the metrics (masked means over the global batch), detached:
    kl the KL term without beta, as TRL logs it (None when beta is 0); TRL's clip indicators: low the ratio below
    1 - epsilon_low with a negative advantage, high above 1 + epsilon_high with a positive one, region either
    (rl/clip_ratio)."""
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    region_clipped: torch.Tensor


def per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                   epsilon_high: float, beta: float, ref_logps: torch.Tensor | None,
                   weight: torch.Tensor | None = None) -> tuple[torch.Tensor, TokenStats]:
    """(the loss of each token [B, T], its TokenStats): -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) with
    r = exp(logps - old_logps) and A the completion's advantage [B], plus beta x r x the k3 KL to the reference,
    exp(ref - logps) - (ref - logps) - 1. The factor r is TRL 1.16's default (use_bias_correction_kl): it makes the
    KL term's gradient the unbiased reverse-KL gradient, and changes it even on-policy, where r is 1 but not constant.
    old_logps are the rollout's (logps.detach() when each rollout batch makes one update, as in TRL); ref_logps are
    needed only when beta > 0. `weight` ([B, T] or [B, 1], rl/off_policy.py's correction) multiplies the clipped
    surrogate, not the KL term, as TRL weights it."""
    advantages = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if weight is not None:
        loss = loss * weight
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"beta is {beta}: per_token_loss needs the reference's log-probs (ref_logps).")
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio
        loss = loss + beta * kl
        kl = kl.detach()
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, TokenStats(kl=kl, low_clipped=low, high_clipped=high, region_clipped=low | high)


def reduce_loss(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, norm: Normalizers) -> torch.Tensor:
    """This micro-batch's share of the step's loss: the shares of all micro-batches on all data-parallel ranks add
    up to TRL's loss on one process holding the whole batch (the caller undoes FSDP's gradient average).
    grpo: the mean over completions of each one's masked token mean; bnpo and dapo: the masked token sum over the
    global batch's tokens; dr_grpo: the masked token sum over completions x max_completion_length.

    bnpo and dapo coincide here: TRL's bnpo divides by the tokens of the micro-batch one process holds, its dapo by
    the whole batch's; on one process holding the whole batch both are the global count (docs/grpo.md)."""
    mask = mask.to(loss.dtype)
    masked = loss * mask
    if loss_type == "grpo":
        return ((masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()) / norm.completions
    if loss_type in ("bnpo", "dapo"):
        return masked.sum() / max(norm.tokens, 1)
    if loss_type == "dr_grpo":
        return masked.sum() / (norm.completions * norm.max_completion_length)
    raise ValueError(f"loss_type is {loss_type!r}; use one of {', '.join(LOSS_TYPES)}.")
