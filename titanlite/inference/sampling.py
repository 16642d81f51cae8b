"""How the next token is picked, as tensor operations only, so the whole token step (forward, sampling, bookkeeping)
compiles to one graph and, on CUDA, replays as one CUDA graph: greedy (argmax) or sampled at a temperature, after
top-k and top-p, with the stop tokens held back until min_new_tokens.

Each prompt has its own random stream, so a completion depends on (seed, its index among all prompts) alone, never
on its batch, the other prompts or the number of ranks. The stream is counter-based (as Philox is): the uniform
number of prompt p's n-th token is a hash of (p's seed, n), computed on the device inside the step. A
torch.Generator per row would need a host loop over rows (torch.multinomial takes one generator) and cannot be
traced into a compiled graph. The token is then drawn by inverting the cumulative distribution with that one
number, which draws exactly from the filtered distribution.
"""

import hashlib
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; temperature 0 = greedy. min_new_tokens: the stop tokens cannot be picked before
    that many new tokens (transformers' min_new_tokens); ignore_eos: the stop tokens end nothing (they are kept as
    tokens, and only max_new_tokens, a stop string or the context end a completion)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None  # None = the tokenizer's eos and end-of-turn tokens (stop_token_ids)
    min_new_tokens: int = 0
    ignore_eos: bool = False


def prompt_seed(seed: int, index: int) -> int:
    """A 32-bit seed for (seed, index): hashed together rather than packed side by side, so that nearby seeds and
    indices give unrelated streams."""
    return int.from_bytes(hashlib.sha256(f"{seed},{index}".encode()).digest()[:4], "little")


def times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32 for x [0, 2**32) in int64, in 16-bit halves: no product reaches 2**63 (a signed
    overflow would be undefined in the compiled C++)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Chris Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row [B], float32: a hash of the row's seed (int64 [B], 32-bit values) and
    the counter (0-dim int64, the token's index among the row's new tokens)."""
    bits = mix(seeds ^ mix((counter * 0x9E3779B9 + 0x632BE5AB) & MASK32))
    return ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 bits: exact in float32, never 0 or 1


def filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, vocab] with the tokens outside the top k, and outside the top-p nucleus, at -inf."""
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        # A token is dropped once the more likely ones already reach top_p; the most likely always stays.
        dropped = (before >= top_p).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(dropped, float("-inf"))
    return logits


def pick_tokens(
    logits: torch.Tensor, sampling: Sampling, seeds: torch.Tensor, counter: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, vocab] -> (the next token of each row [B], its log-probability [B] float32 under
    log_softmax(logits / temperature), before top-k and top-p: the sampler's; greedy: temperature 1's). Row i draws
    with seeds[i] at `counter` (uniforms). No host sync."""
    logits = logits.float()
    if sampling.temperature == 0:
        picked = logits.argmax(dim=-1)
        return picked, logits.log_softmax(dim=-1).gather(-1, picked[:, None])[:, 0]
    logits = logits / sampling.temperature
    cdf = filtered(logits, sampling.top_k, sampling.top_p).softmax(dim=-1).cumsum(dim=-1)
    below = cdf < uniforms(seeds, counter)[:, None] * cdf[:, -1:]
    picked = below.sum(dim=-1).clamp(max=logits.shape[-1] - 1)  # the first token whose cdf reaches the number
    return picked, logits.log_softmax(dim=-1).gather(-1, picked[:, None])[:, 0]
