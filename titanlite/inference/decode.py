"""Token generation with the static KV cache (models/kv_cache.py): prompts of different lengths left-padded into
one batch, one prefill forward, then one decode step (one token per row) per new token, greedy or sampled
(temperature, top-k, top-p; each prompt with its own generator), each row ending at the tokenizer's eos or an
end-of-turn token, at a stop string, or at max_new_tokens. The tokens, their log-probabilities and each row's first
stop token stay on the device; the host looks every CHECK_EVERY steps. api.LM (which python -m titanlite.generate,
the lm-eval model and the in-loop evaluator's sample prompts use) calls `generate_ids`.

Ranks that each generate for their own prompts on a sharded (FSDP) model run in lockstep (`lockstep`): every
forward gathers weights from all ranks, so the ranks look at the same steps, and a rank whose rows are finished
runs idle one-token forwards (without its cache) until every rank is finished.
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


def pick_tokens(logits: torch.Tensor, sampling: Sampling,
                generators: list[torch.Generator] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, vocab] -> (the next token of each row [B], row i sampled with generators[i]; its log-probability
    under the model at temperature 1 [B], float32). No host sync."""
    logprobs = logits.float().log_softmax(dim=-1)
    if sampling.temperature == 0:
        picked = logits.argmax(dim=-1)
        return picked, logprobs.gather(-1, picked[:, None])[:, 0]
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
    picked = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
    return picked, logprobs.gather(-1, picked[:, None])[:, 0]


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


def text_stop_index(ids: list[int], tokenizer, stop: tuple[str, ...], start: int) -> int | None:
    """The index of the first token of `ids` at or after `start` whose text completes a stop string (the tokens
    before `start` were checked already), None where none does."""
    if not any(s in tokenizer.decode(ids) for s in stop):  # the usual case: one decode, not one per token
        return None
    for end in range(start, len(ids)):
        text = tokenizer.decode(ids[:end + 1])
        if any(s in text for s in stop):
            return end
    return None


@dataclass(frozen=True)
class Generated:
    """One prompt's new tokens, each one's log-probability under the model at temperature 1, and why it ended:
    "eos" (a stop token, not included), "stop" (a stop string; the token completing it included, the caller cuts
    the text) or "length" (max_new_tokens or the model's context)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_token: int | None = None  # the stop token that ended it (finish_reason "eos"), left out of token_ids


class Rows:
    """The host's view of the batch's rows, brought up to date at each check: where each stopped, by a stop token
    (eos_at) or a stop string (text_at), as an index into its new tokens."""

    def __init__(self, count: int, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.eos_at: list[int | None] = [None] * count
        self.text_at: list[int | None] = [None] * count
        self.ids: list[list[int]] = [[] for _ in range(count)]
        self.checked = 0  # tokens of every row already searched for stop strings

    def update(self, ids: list[list[int]], eos_at: list[int], made: int) -> None:
        """ids: every row's `made` tokens so far; eos_at: each row's first stop token (made or more = none yet)."""
        self.ids = ids
        for row, at in enumerate(eos_at):
            self.eos_at[row] = at if at < made else None
            if self.stop and self.text_at[row] is None:
                end = made if self.eos_at[row] is None else self.eos_at[row]
                self.text_at[row] = text_stop_index(ids[row][:end], self.tokenizer, self.stop, min(self.checked, end))
        self.checked = made

    def done(self) -> bool:
        return all(e is not None or t is not None for e, t in zip(self.eos_at, self.text_at))

    def results(self, logprobs: list[list[float]]) -> list[Generated]:
        out = []
        for row, ids in enumerate(self.ids):
            eos, text = self.eos_at[row], self.text_at[row]
            if text is not None:  # found before any stop token
                out.append(Generated(ids[:text + 1], logprobs[row][:text + 1], "stop"))
            elif eos is not None:
                out.append(Generated(ids[:eos], logprobs[row][:eos], "eos", ids[eos]))
            else:
                out.append(Generated(ids, logprobs[row][:len(ids)], "length"))
        return out


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


CHECK_EVERY = 16  # decode steps between the host's looks at the rows (stop tokens, stop strings, lockstep)


def decode_step(model: nn.Module, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """One token per row [B] -> the next token's logits [B, vocab]: the function `compile` compiles."""
    return model(tokens[:, None], cache=cache.decode())[:, -1]


def cache_capacity(width: int, budget: int) -> int:
    """Columns the cache holds: the prompts' width and the new tokens, rounded up to a multiple of 64, so that
    calls with nearby lengths share one shape (and one compiled decode step)."""
    return -(-(width + budget) // 64) * 64


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate_ids(model: nn.Module, args, tokenizer, prompts: list[list[int]], sampling: Sampling, *,
                 lockstep: bool = False, indices: list[int] | None = None, speed: Speed | None = None,
                 step=decode_step) -> list[Generated]:
    """Each prompt's Generated, one batch: the new tokens up to (excluding) the first stop token, or up to and
    including the token that completed a stop string (the caller cuts the text), or max_new_tokens, or the model's
    context (said once). With `lockstep`, every rank of the world calls this together.
    indices: each prompt's place among all prompts, which seeds its sampling (default 0, 1, ...); `speed`, where
    given, adds this batch's tokens and seconds; `step`: decode_step, or it compiled.

    The tokens stay on the device while they are made: the host looks every CHECK_EVERY steps (and when the budget
    is spent), and a row finished meanwhile keeps decoding until then, its extra tokens dropped."""
    check_prompts(prompts, args.max_seq_len, args.vocab_size)
    device = next(model.parameters()).device
    budget = min(sampling.max_new_tokens, args.max_seq_len - max(map(len, prompts)))
    if budget < sampling.max_new_tokens:
        logger.info(f"generating at most {budget} tokens: the longest prompt and max_new_tokens would pass the model's "
                    f"context of {args.max_seq_len}")
    stops = torch.tensor(stop_token_ids(tokenizer) if sampling.stop_ids is None else list(sampling.stop_ids),
                         dtype=torch.long, device=device)
    generators = prompt_generators(sampling, list(range(len(prompts))) if indices is None else indices, device)
    started = time.perf_counter()
    tokens, valid = left_padded(prompts, tokenizer.eos_id, device)
    cache = KVCache(len(prompts), cache_capacity(tokens.shape[1], budget), getattr(args, "sliding_window", None), device)
    logits = model(tokens, cache=cache.prefill(valid))[:, -1]
    synchronize(device)
    prefilled = time.perf_counter()
    new = torch.zeros(len(prompts), budget, dtype=torch.long, device=device)
    logprobs = torch.zeros(len(prompts), budget, device=device)
    eos_at = torch.full((len(prompts),), budget, dtype=torch.long, device=device)  # each row's first stop token
    rows = Rows(len(prompts), tokenizer, sampling.stop)
    made, forwards, finished = 0, 0, False
    while True:
        if not finished:
            picked, picked_logprobs = pick_tokens(logits, sampling, generators)
            new[:, made], logprobs[:, made] = picked, picked_logprobs
            eos_at = torch.where(torch.isin(picked, stops) & (eos_at == budget), made, eos_at)
            made += 1
        # In lockstep every rank looks at the same forwards; alone, also when the budget is spent.
        if forwards % CHECK_EVERY == 0 or (made == budget and not lockstep):
            if rows.checked < made:
                rows.update(new[:, :made].tolist(), eos_at.tolist(), made)
            finished = finished or rows.done() or made == budget
            if all_finished(finished, lockstep, device):
                break
        if finished or made == budget:  # lockstep: this rank's share of the others' forwards
            finished = True
            idle_forward(model, device)
        else:
            logits = step(model, cache, new[:, made - 1])
        forwards += 1
    results = rows.results(logprobs[:, :made].tolist())
    if speed is not None:
        speed.prefill_tokens += sum(map(len, prompts))
        speed.prefill_seconds += prefilled - started
        # The decode forwards' tokens that went into a completion (the first new token came from the prefill).
        speed.decode_tokens += sum(len(r.token_ids) - (r.finish_reason != "eos") for r in results)
        speed.decode_seconds += time.perf_counter() - prefilled
    return results


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
