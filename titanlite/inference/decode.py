"""Token generation with the KV cache (models/kv_cache.py): prompts of different lengths left-padded into
one batch, one prefill forward, then one forward per new token, greedy or sampled (temperature, top-k,
top-p), each row ending at the tokenizer's eos or an end-of-turn token, at a stop string, or at
max_new_tokens. python -m titanlite.generate (generate_job.py), the lm-eval model (lm_eval_model.py) and the
in-loop evaluator's sample prompts all call `generate_ids`.

Ranks that each generate for their own prompts on a sharded (FSDP) model run in lockstep (`lockstep`): every
forward gathers weights from all ranks, so a rank whose rows are finished runs idle one-token forwards (without
its cache) until every rank is finished.
"""

import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.kv_cache import KVCache

# Special tokens that end an assistant's turn in the common chat templates; those the tokenizer knows stop generation.
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end▁of▁sentence|>",
               "<end_of_turn>", "<|end|>")


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked; temperature 0 = greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None  # None = the tokenizer's eos and end-of-turn tokens (stop_token_ids)


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos and the END_OF_TURN tokens it has as single special tokens."""
    ids = {tokenizer.eos_id}
    for name in END_OF_TURN:
        encoded = tokenizer.encode(name, bos=False, eos=False)
        if len(encoded) == 1 and tokenizer.decode(encoded) == name:
            ids.add(encoded[0])
    return sorted(ids)


def prompt_generators(sampling: Sampling, indices: list[int], device: torch.device) -> list[torch.Generator] | None:
    """One generator per prompt, seeded from (generate.seed, the prompt's index among all prompts): a completion
    depends on neither the batch it runs in nor the number of prompts or ranks. None when greedy."""
    if sampling.temperature == 0:
        return None
    return [torch.Generator(device=device).manual_seed(prompt_seed(sampling.seed, index)) for index in indices]


def prompt_seed(seed: int, index: int) -> int:
    """A 32-bit seed for (seed, index): the CPU generator (mt19937) keeps only a seed's low 32 bits, so the two are
    hashed together rather than packed side by side."""
    return int.from_bytes(hashlib.sha256(f"{seed},{index}".encode()).digest()[:4], "little")


def pick_tokens(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator] | None) -> torch.Tensor:
    """logits [B, vocab] -> the next token of each row [B], row i sampled with generators[i]."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
        # A token is dropped once the more likely ones already reach top_p; the most likely always stays.
        dropped = (before >= sampling.top_p).scatter(-1, order, before >= sampling.top_p)
        logits = logits.masked_fill(dropped, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] tokens, [B, T] valid) with each prompt at the right end of its row."""
    width = max(map(len, prompts))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        tokens[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        valid[row, width - len(ids):] = True
    return tokens.to(device), valid.to(device)


def check_prompts(prompts: list[list[int]], max_seq_len: int, vocab_size: int) -> None:
    for number, ids in enumerate(prompts, 1):
        if not ids:
            raise UserError(f"prompt {number} is empty; give every prompt at least one token")
        if len(ids) >= max_seq_len:
            raise UserError(f"prompt {number} has {len(ids)} tokens, but the model's context is {max_seq_len}, which must "
                            "also hold a new token; shorten the prompt")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise UserError(f"prompt {number} holds token id {max(ids) if max(ids) >= vocab_size else min(ids)}, outside "
                            f"the model's vocabulary of {vocab_size}; use ids from 0 to {vocab_size - 1}")


def stopped_by_text(new_ids: list[int], tokenizer, stop: tuple[str, ...]) -> bool:
    text = tokenizer.decode(new_ids)
    return any(s in text for s in stop)


@dataclass
class Speed:
    """Tokens the model read and seconds it took, for the prefill (prompts, and lm-eval's scored sequences) and
    the decode steps (one token per unfinished row per forward); each phase ends at a host sync."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def line(self) -> str:
        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens / seconds:.1f} tokens/s ({tokens} tokens in {seconds:.2f}s)" if seconds else "none"

        return (f"prefill {rate(self.prefill_tokens, self.prefill_seconds)}, "
                f"decode {rate(self.decode_tokens, self.decode_seconds)}")


@torch.no_grad()
def generate_ids(model: nn.Module, args, tokenizer, prompts: list[list[int]], sampling: Sampling,
                 lockstep: bool = False, indices: list[int] | None = None, speed: Speed | None = None) -> list[list[int]]:
    """The new tokens of each prompt, one batch: up to (excluding) the first stop token, or up to and
    including the token that completed a stop string (the caller cuts the text), or max_new_tokens,
    or the model's context (said once). With `lockstep`, every rank of the world calls this together.
    indices: each prompt's place among all prompts, which seeds its sampling (default 0, 1, ...); `speed`, where
    given, adds this batch's tokens and seconds."""
    check_prompts(prompts, args.max_seq_len, args.vocab_size)
    device = next(model.parameters()).device
    budget = min(sampling.max_new_tokens, args.max_seq_len - max(map(len, prompts)))
    if budget < sampling.max_new_tokens:
        logger.info(f"generating at most {budget} tokens: the longest prompt and max_new_tokens would pass the model's "
                    f"context of {args.max_seq_len}")
    stops = torch.tensor(stop_token_ids(tokenizer) if sampling.stop_ids is None else list(sampling.stop_ids), device=device)
    generators = prompt_generators(sampling, list(range(len(prompts))) if indices is None else indices, device)
    started = time.perf_counter()
    tokens, valid = left_padded(prompts, tokenizer.eos_id, device)
    cache = KVCache(getattr(args, "sliding_window", None))
    logits = model(tokens, cache=cache.step(valid))[:, -1]
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    prefilled, decoded = None, 0
    while True:
        if budget and not all(done):
            budget -= 1
            picked = pick_tokens(logits, sampling, generators)
            for row, (token, stopping) in enumerate(zip(picked.tolist(), torch.isin(picked, stops).tolist())):
                if done[row] or stopping:
                    done[row] = True
                    continue
                new[row].append(token)
                done[row] = bool(sampling.stop) and stopped_by_text(new[row], tokenizer, sampling.stop)
        prefilled = prefilled or time.perf_counter()  # the first tokens' .tolist() waited for the prefill
        finished = all(done) or not budget
        if all_finished(finished, lockstep, device):
            if speed is not None:
                speed.prefill_tokens += sum(map(len, prompts))
                speed.prefill_seconds += prefilled - started
                speed.decode_tokens += decoded
                speed.decode_seconds += time.perf_counter() - prefilled
            return new
        if finished:
            idle_forward(model, device)
        else:
            decoded += done.count(False)
            logits = model(picked[:, None], cache=cache.step(torch.ones_like(picked[:, None], dtype=torch.bool)))[:, -1]


def all_finished(finished: bool, lockstep: bool, device: torch.device) -> bool:
    """Whether this rank (alone) or, in lockstep, every rank is finished."""
    if not lockstep:
        return finished
    flag = torch.tensor([float(finished)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def idle_forward(model: nn.Module, device: torch.device) -> None:
    """One forward of one token, without a cache, whose output is dropped: a finished rank's share of the sharded
    model's collectives while other ranks still need them."""
    model(torch.zeros(1, 1, dtype=torch.long, device=device))
