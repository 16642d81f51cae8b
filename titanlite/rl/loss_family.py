"""TRL 1.16's GRPO loss family as plain tensor functions (GRPOTrainer._compute_loss, get_high_entropy_mask,
get_gamma_weights, and the multi-objective advantages of _generate_and_score_completions), each reduced by the
GLOBAL batch's counts so that the shares of every micro-batch on every data-parallel rank add up to the loss one
process computes over the whole batch (2 ranks = 1 process, any accumulation = none).

    aggregated_advantages  rewards per function -> advantages, rl.multi_objective_aggregation
    check_loss_settings    TRL's refusals (ValueError) and its warnings (returned) for a LossSettings
    kept_entropies         this rank's trained tokens' entropies, gathered over the data-parallel group
    entropy_threshold      the entropy at quantile 1 - top_entropy_quantile of the global batch's trained tokens
    high_entropy_mask      the trained tokens at or above that threshold (TRL's entropy_mask)
    per_token_loss         the policy term of rl.loss_type at rl.importance_sampling_level, the entropy mask, the
                           sampler's correction and beta x the KL, per token, and the clip indicators
    reduce_loss            a micro-batch's share of the step's loss, normalised by the global batch's counts
    entropy_bonus          a micro-batch's share of -entropy_coef x the mean entropy of the global batch's tokens

Top-entropy masking over 2 ranks: TRL takes the quantile over the tokens of the micro-batches its processes hold at
once (gathered across processes), so its accumulation changes the mask. Here the threshold is one number for the
step, that of the whole global batch under the current policy: every rank gathers its trained tokens' entropies
with kept_entropies (a collective) and takes entropy_threshold of them, which also counts the tokens at or above it
(Normalizers.entropy_tokens); each micro-batch masks with that threshold, as one process holding the whole batch
does. With one micro-batch per rank the entropies are those of the loss forward itself; with several, a forward
without gradient over the rank's rows before the first one gives them (the same weights, the same numbers).
"""

import dataclasses
import math

import torch
import torch.distributed as dist

from titanlite.config_sections import GRPO_LOSS_TYPES as LOSS_TYPES
from titanlite.config_sections import IMPORTANCE_SAMPLING_LEVELS
from titanlite.config_sections import REWARD_AGGREGATIONS as AGGREGATIONS
from titanlite.data.batch import Normalizers
from titanlite.rl.grpo_loss import STD_EPS, group_advantages, nanstd

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's -min(r A, clip(r) A)
LOG_W_MIN = math.log(1e-8)  # TRL's vespo clamp of the sequence's log-weight, below
LOG_W_MAX = 20.0


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The [rl] keys the loss reads, with TRL 1.16's GRPOConfig names and defaults (epsilon_low is its epsilon;
    epsilon_high is 1 + the upper clip, except for cispo, where it is the cap on the ratio itself, TRL's eps_max)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """Detached per-token statistics of per_token_loss, [B, T] whatever the importance level (a sequence's value
    repeated over its tokens): kl the KL term without beta (None when beta is 0); TRL's clip indicators: low the
    ratio below 1 - epsilon_low with a negative advantage, high above 1 + epsilon_high with a positive one (cispo:
    above its cap epsilon_high, TRL's cispo_clip_ratio; sapo and vespo clip nothing), region either."""

    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    region_clipped: torch.Tensor


def check_loss_settings(s: LossSettings) -> list[str]:
    """TRL's warnings about s, one sentence each (the caller logs them); raises ValueError, naming the rl.* key and
    the fix, for what TRL cannot compute (an unknown name, a quantile outside [0, 1], a sapo temperature it would
    divide by that is not positive)."""
    if s.loss_type not in LOSS_TYPES:
        raise ValueError(f"rl.loss_type is {s.loss_type!r}; use one of {', '.join(LOSS_TYPES)}.")
    if s.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"rl.importance_sampling_level is {s.importance_sampling_level!r}; use token or sequence.")
    if not 0.0 <= s.top_entropy_quantile <= 1.0:
        raise ValueError(
            f"rl.top_entropy_quantile is {s.top_entropy_quantile}; use a share of tokens in [0, 1] "
            "(1 keeps every token)."
        )
    for key in ("sapo_temperature_neg", "sapo_temperature_pos"):
        if s.loss_type == "sapo" and getattr(s, key) <= 0:
            raise ValueError(
                f"rl.{key} is {getattr(s, key)}; sapo divides by it: set it above 0 (TRL's default "
                f"{getattr(LossSettings, key)})."
            )
    warnings = []
    if s.loss_type == "luspo" and s.importance_sampling_level != "sequence":
        warnings.append(
            "rl.loss_type luspo is meant for sequence-level weights (the LUSPO paper's setup); set "
            "rl.importance_sampling_level to sequence."
        )
    if s.loss_type == "vespo" and s.importance_sampling_level != "token":
        warnings.append(
            "rl.loss_type vespo computes its sequence-level weights itself; set "
            "rl.importance_sampling_level to token (its default)."
        )
    if s.importance_sampling_level == "sequence" and s.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.append(
            f"rl.importance_sampling_level sequence with rl.loss_type {s.loss_type} sums token losses, "
            "which weights each sequence by its length; set rl.loss_type grpo for GSPO's objective."
        )
    return warnings


def aggregated_advantages(
    rewards_per_function: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    aggregation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], zero_std [N]) of the global batch from its rewards [N, F] (NaN where a function returned
    None), as TRL's _generate_and_score_completions (multi_objective_aggregation):
    sum_then_normalize: r = sum_f w_f r_f (NaN-skipping), then group_advantages(r) as scale_rewards says;
    normalize_then_sum (GDPO): each function's rewards normalised in their group, (r_f - mean) / (std + 1e-4), then
    r = sum_f w_f of those, and A = (r - mean(r)) / (std(r) + 1e-4) over the batch (scale_rewards is not read).
    A completion every function left None has advantage 0."""
    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_function * weights[None]).nansum(dim=1)
        return group_advantages(rewards.masked_fill(unscorable, float("nan")), num_generations, scale_rewards)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"rl.multi_objective_aggregation is {aggregation!r}; use one of {', '.join(AGGREGATIONS)}.")
    grouped = rewards_per_function.view(-1, num_generations, rewards_per_function.shape[1])
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + STD_EPS)).view_as(rewards_per_function)
    rewards = (normalized * weights[None]).nansum(dim=1).masked_fill(unscorable, float("nan"))
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def kept_entropies(entropies: torch.Tensor, mask: torch.Tensor, sharing: int = 1) -> torch.Tensor:
    """The entropies of the tokens mask keeps, of this rank's rows, followed by every other rank's (in rank order,
    one of each `sharing` neighbouring ranks: a TP group holds the same rows), when a process group is initialised:
    what TRL's get_high_entropy_mask gathers, padded to one length and the padding dropped."""
    local = entropies.detach()[mask.bool()]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    sizes = [torch.zeros((), dtype=torch.long, device=local.device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(len(local), device=local.device))
    longest = int(max(sizes))
    padded = torch.cat([local, local.new_zeros(longest - len(local))])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(size)] for part, size in list(zip(parts, sizes))[::sharing]])


def entropy_threshold(kept: torch.Tensor, top_entropy_quantile: float) -> tuple[torch.Tensor, int]:
    """(the entropy at quantile 1 - top_entropy_quantile of kept, the global batch's trained tokens' entropies, as
    torch.quantile computes it on their fp32 values (TRL's entropy_threshold); how many of kept are at or above it:
    Normalizers.entropy_tokens). Written with a sort, not torch.quantile, which refuses more than 2**24 values."""
    if kept.numel() == 0:
        return kept.new_full((), float("inf"), dtype=torch.float32), 0
    values = kept.float().sort().values
    rank = torch.tensor(1 - top_entropy_quantile, dtype=values.dtype, device=values.device) * (len(values) - 1)
    below = rank.floor().long()
    above = rank.ceil().long()
    threshold = torch.lerp(values[below], values[above], rank - below)
    return threshold, int((kept >= threshold).sum())


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The trained tokens whose entropy is at or above threshold [B, T] bool (TRL's get_high_entropy_mask after its
    quantile; an empty batch's threshold is inf: nothing kept, as TRL)."""
    return (entropies * mask.float() >= threshold) & mask.bool()


def log_importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """TRL's log_importance_weights: token, log r_t = logps - old_logps [B, T]; sequence (GSPO), the mean of log r_t
    over the completion's trained tokens [B, 1]."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"rl.importance_sampling_level is {level!r}; use token or sequence.")


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sampling_ratio: torch.Tensor | None,
    s: LossSettings,
) -> torch.Tensor:
    """VESPO's weight of each sequence, phi(w) = e^lambda w^k e^(-lambda w) [B, 1], no gradient (TRL's
    get_gamma_weights -> phi_seq): log w = sum over trained tokens of log r_t clamped to [-20, 20], plus the
    sampler's log-correction (its log clamped to [log 1e-8, 20], every position), clamped to [log 1e-8, 20];
    k, lambda = vespo_k_pos, vespo_lambda_pos for A >= 0, vespo_k_neg, vespo_lambda_neg below; NaN or inf -> 0."""
    log_w = torch.sum(torch.clamp(log_ratio, -LOG_W_MAX, LOG_W_MAX) * mask, dim=-1, keepdim=True)
    if sampling_ratio is not None:
        log_w += torch.sum(torch.clamp(torch.log(sampling_ratio), LOG_W_MIN, LOG_W_MAX), dim=-1, keepdim=True)
    log_w = torch.clamp(log_w, LOG_W_MIN, LOG_W_MAX)
    nonneg = advantages >= 0
    k = torch.where(nonneg, s.vespo_k_pos, s.vespo_k_neg)
    lam = torch.where(nonneg, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_term(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: LossSettings,
    sampling_ratio: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the policy loss per token [B, T] or per sequence [B, 1], the importance weight r = exp(log weight)), A the
    advantage [B, 1] and r at s.importance_sampling_level, as TRL's _compute_loss:
    grpo, bnpo, dr_grpo, dapo, luspo: -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A);
    cispo: -sg(min(r, epsilon_high)) A logps;  sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau sapo_temperature_pos
    for A > 0 and _neg otherwise;  vespo: -gamma_weights A logps (r unused by the loss)."""
    ratio = torch.exp(log_importance_weights(logps, old_logps, mask, s.importance_sampling_level))
    if s.loss_type == "cispo":
        return -torch.clamp(ratio, max=s.epsilon_high).detach() * advantages * logps, ratio
    if s.loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
        return -torch.min(ratio * advantages, clipped * advantages), ratio
    if s.loss_type == "sapo":
        tau = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, ratio
    if s.loss_type == "vespo":
        if sampling_ratio is not None and sampling_ratio.shape[-1] != logps.shape[-1]:
            raise ValueError(
                "rl.loss_type vespo needs the sampler's correction per token, not per sequence; use a "
                "token-level correction or another rl.loss_type."
            )
        phi = gamma_weights(advantages, logps - old_logps, mask, sampling_ratio, s)
        return -phi * advantages * logps, ratio
    raise ValueError(f"rl.loss_type is {s.loss_type!r}; use one of {', '.join(LOSS_TYPES)}.")


def clip_stats(
    ratio: torch.Tensor, advantages: torch.Tensor, s: LossSettings, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) clip indicators [B, T] as TRL counts them for s.loss_type (TokenStats)."""
    with torch.no_grad():
        if s.loss_type in CLIPPED_LOSS_TYPES:
            low = (ratio < 1 - s.epsilon_low) & (advantages < 0)
            high = (ratio > 1 + s.epsilon_high) & (advantages > 0)
        elif s.loss_type == "cispo":
            low, high = torch.zeros_like(ratio, dtype=torch.bool), (ratio > s.epsilon_high) & (advantages > 0)
        else:
            low = high = torch.zeros_like(ratio, dtype=torch.bool)
    return low.expand(shape), high.expand(shape)


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: LossSettings,
    *,
    ref_logps: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sampling_ratio: torch.Tensor | None = None,
    off_policy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """(the loss of each token [B, T], or of each sequence [B, 1] at importance level sequence without beta or
    masks, its TokenStats), in TRL's order: policy_term; times off_policy_mask [B, 1] (rl/off_policy.py); times
    entropy_mask (high_entropy_mask, when
    top_entropy_quantile < 1); times sampling_ratio [B, T] or [B, 1], the sampler's correction (not for vespo,
    which takes it into its weights); plus beta x r x the k3 KL, exp(ref - logps) - (ref - logps) - 1 (TRL's
    use_bias_correction_kl, r at the importance level). old_logps are the rollout's (logps.detach() when each
    rollout batch makes one update); advantages [B]; ref_logps are needed only when beta > 0."""
    advantages = advantages[:, None]
    loss, ratio = policy_term(logps, old_logps, advantages, mask, s, sampling_ratio)
    if off_policy_mask is not None:
        loss = loss * off_policy_mask
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if sampling_ratio is not None and s.loss_type != "vespo":
        loss = loss * sampling_ratio
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"rl.beta is {s.beta}: per_token_loss needs the reference's log-probs (ref_logps).")
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio
        loss = loss + s.beta * kl
        kl = kl.detach()
    low, high = clip_stats(ratio, advantages, s, logps.shape)
    return loss, TokenStats(kl=kl, low_clipped=low, high_clipped=high, region_clipped=low | high)


def reduce_loss(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, norm: Normalizers) -> torch.Tensor:
    """This micro-batch's share of the step's policy loss (loss [B, T] or [B, 1]): the shares of all micro-batches
    on all ranks add up to TRL's on one process holding the whole batch (the caller undoes FSDP's average).
    grpo, sapo: the mean over completions of each one's masked token mean; bnpo, dapo, cispo, vespo: the masked
    token sum over the global batch's tokens; dr_grpo: that sum over completions x max_completion_length; luspo:
    the mean over completions of each one's masked token sum (a sequence's loss times its length).
    bnpo equals dapo here: TRL's divides by the tokens one process holds, which are the global batch's on one."""
    mask = mask.to(loss.dtype)
    masked = loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / norm.completions
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return masked.sum() / max(norm.tokens, 1)
    if loss_type == "dr_grpo":
        return masked.sum() / (norm.completions * norm.max_completion_length)
    if loss_type == "luspo":
        return masked.sum() / norm.completions
    raise ValueError(f"rl.loss_type is {loss_type!r}; use one of {', '.join(LOSS_TYPES)}.")


def entropy_bonus(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    entropy_mask: torch.Tensor | None,
    entropy_coef: float,
    norm: Normalizers,
) -> torch.Tensor:
    """This micro-batch's share of -entropy_coef x H, H the mean entropy of the global batch's trained tokens (those
    the entropy mask keeps, when there is one), TRL's entropy bonus (loss - entropy_coef x entropy_loss);
    entropies must carry their gradient for it to act (TRL's do): refused when they cannot."""
    if entropy_coef and torch.is_grad_enabled() and not entropies.requires_grad:
        raise ValueError(
            f"rl.entropy_coef is {entropy_coef} but the entropies carry no gradient, so the bonus "
            "would change nothing; compute them with their gradient."
        )
    kept = mask.to(entropies.dtype) if entropy_mask is None else (mask.bool() & entropy_mask).to(entropies.dtype)
    count = norm.tokens if norm.entropy_tokens is None else norm.entropy_tokens
    return -entropy_coef * (entropies * kept).sum() / max(count, 1)
