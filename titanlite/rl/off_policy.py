"""Off-policy correction of GRPO's loss, with TRL 1.16's meanings (GRPOTrainer's vllm_importance_sampling_mode,
_clip_min/_max and off_policy_mask_threshold): where the completions were sampled by weights or code other than the
trainer's (a gathered copy in another precision, an engine of its own, stale weights), each token's clipped surrogate
is weighted by the trainer/sampler probability ratio, truncated or masked, and a sequence that moved too far from the
sampler with a negative advantage is dropped (DeepSeek-V3.2's off-policy sequence mask). The KL penalty is neither.

    importance_ratio   old (the trainer's log-probs the clipped ratio is taken against) and the sampler's ->
                       the weight of each token ([B, T], token_*) or sequence ([B, 1], sequence_*)
    off_policy_mask    [B, 1]: 1 where the advantage is >= 0 or the mean sampler - trainer log-ratio <= threshold
"""

import math

import torch

from titanlite.config_sections import IMPORTANCE_SAMPLING_MODES


def importance_ratio(
    old: torch.Tensor,
    sampler: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """exp(old - sampler) per token (token_*) or summed over each completion's tokens (sequence_*), then clamped into
    [clip_min, clip_max] (*_truncate) or set to 0 outside it (*_mask); None leaves that side open. A sampler
    log-probability that is NaN counts as no difference (ratio 1), as in TRL."""
    if mode not in IMPORTANCE_SAMPLING_MODES[1:]:
        raise ValueError(f"mode is {mode!r}; use one of {', '.join(IMPORTANCE_SAMPLING_MODES[1:])}.")
    difference = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        difference = difference.sum(dim=-1, keepdim=True)
    ratio = torch.exp(difference)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def off_policy_mask(
    advantages: torch.Tensor, logps: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """[B, 1] (in mask's dtype): keep a completion whose advantage [B] is not negative, or whose mean over its
    tokens of sampler - trainer log-probabilities (the KL estimate, NaN counted as 0) is at most `threshold`."""
    kl = torch.nan_to_num(sampler - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages[:, None] >= 0) | (mean_kl <= threshold)).to(mask.dtype)
