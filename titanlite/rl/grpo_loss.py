"""GRPO's advantages and log-probabilities as plain tensor functions, with TRL 1.16's meanings (GRPOTrainer's
_generate_and_score_completions for the advantages, _get_per_token_logps_and_entropies for the log-probabilities); the
losses built from them are rl/loss_family.py's; docs/grpo.md has the formulas.

    group_advantages   the global batch's rewards -> each completion's advantage (and whether its std was zero)
    token_logps        logits -> the targets' log-probs and the entropy, of logits / temperature
"""

import torch
from torch.distributed.tensor import DTensor

from titanlite.config_sections import REWARD_SCALINGS

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


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each completion's advantage [N], whether the std that scales it is zero [N] bool, TRL's is_std_zero behind
    rl/frac_reward_zero_std). rewards [N] is the whole global batch, completion i of prompt i // num_generations,
    already summed over the reward functions; NaN marks a completion no function scored (TRL: every function
    returned None): it is left out of its group's mean and std and its advantage is 0.

    The advantage is the reward minus its group's mean, divided by (std + 1e-4) with the group's std ("group") or
    the whole batch's ("batch"), or not divided ("none"); zero_std reads the group's std for "group" and "none", the
    batch's for "batch", as TRL does."""
    if scale_rewards not in REWARD_SCALINGS:
        raise ValueError(f"scale_rewards is {scale_rewards!r}; use one of {', '.join(REWARD_SCALINGS)}.")
    if rewards.dim() != 1 or len(rewards) % num_generations:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}; it must be [N] with N a multiple of "
            f"num_generations ({num_generations})."
        )
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if len(rewards) > 1 else torch.zeros_like(rewards)
    else:
        std = (
            nanstd(groups, dim=1).repeat_interleave(num_generations)
            if num_generations > 1
            else torch.zeros_like(rewards)
        )
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
    no fp32 copy of all the logits is made or kept for backward (only each position's logsumexp and entropy are),
    and the backward recomputes each chunk's softmax. The entropy carries its gradient (rl.entropy_coef's bonus);
    where it is only a statistic its gradient is None and costs nothing."""

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
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for row, part in _chunks(logits):
            log_p = (logits[row, part].float() / ctx.temperature).sub_(lse[row, part, None])
            p = log_p.exp()
            g = torch.zeros_like(p)
            if grad_logps is not None:  # d logp_t / d logit_v = (onehot_t(v) - p_v) / temperature
                scale = grad_logps[row, part, None] / ctx.temperature
                g.sub_(p * scale).scatter_add_(-1, targets[row, part, None], scale)
            if grad_entropy is not None:  # d H / d logit_v = -p_v (log p_v + H) / temperature
                g.sub_(p * (log_p + entropy[row, part, None]) * (grad_entropy[row, part, None] / ctx.temperature))
            grad[row, part] = g
        return grad, None, None


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of targets [B, T] fp32, entropy [B, T] fp32) under softmax(logits / temperature),
    logits [B, T, V] in any float dtype, as TRL scores completions (it divides by the sampling temperature too).
    Every target must be a vocabulary id: a masked position's value is meaningless and reduce_loss drops it.
    Logits that are vocab-sharded DTensors (TP's loss parallel) are gathered whole first."""
    if temperature <= 0:
        raise ValueError(f"temperature is {temperature}; it must be positive.")
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return _TokenLogps.apply(logits, targets, float(temperature))
