"""RoPE for multi-head latent attention: tables over the qk_rope_head_dim dimensions only, with
DeepSeek's YaRN scaling of the frequencies and the two YaRN magnitudes (on cos/sin, on the softmax).

The formulas are YaRN's (arXiv 2309.00071) as DeepSeek-V2/V3 configure them and as transformers'
_compute_yarn_parameters and DeepSeek's inference/model.py compute them: the correction range is
rounded outwards (floor, ceil) and clamped to the dimensions.
"""

import math

import torch

from titanlite.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, positions: int) -> float:
    """The dimension whose frequency turns `rotations` times over `positions` positions."""
    return dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_freqs(dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """[dim // 2] frequencies: the fast ones (below beta_fast turns) as RoPE's, the slow ones (beyond
    beta_slow turns) divided by `factor`, a linear ramp between."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, theta, yarn.original_max_seq_len)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, theta, yarn.original_max_seq_len)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def rope_tables(args: DeepSeekV3Args, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), each [max_seq_len, qk_rope_head_dim // 2], float32,
    already multiplied by YaRN's cos/sin magnitude (1.0 for DeepSeek-V3's mscale == mscale_all_dim)."""
    dim, yarn = args.qk_rope_head_dim, args.rope_scaling
    if yarn is None:
        freqs, magnitude = 1.0 / args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    else:
        freqs = yarn_freqs(dim, args.rope_theta, yarn)
        magnitude = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs).to(device)
    return angles.cos() * magnitude, angles.sin() * magnitude


def softmax_scale(args: DeepSeekV3Args) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) ** 2 when the frequencies are stretched."""
    scale = args.qk_head_dim**-0.5
    yarn = args.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale
