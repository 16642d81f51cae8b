"""Token generation with the static KV cache (models/kv_cache.py): prompts of different lengths left-padded into
one batch, one prefill forward, then one token step per new token, each row ending at the tokenizer's eos or an
end-of-turn token, at a stop string, or at max_new_tokens. The token step is the whole of it: the forward of one
token per row, the pick (sampling.py: greedy or sampled, each prompt with its own random stream) and the
bookkeeping (the token, its log-probability and each row's first stop token written into the batch's tensors on
the device), so it compiles to one graph and, on CUDA, replays as one CUDA graph (CudaGraphStep). The host looks at
the rows every CHECK_EVERY steps. api.LM (which python -m titanlite.generate, the lm-eval model and the in-loop
evaluator's sample prompts use) and GRPO's rollouts call `generate_ids`.

Ranks that each generate for their own prompts on a sharded (FSDP) model run in lockstep (`lockstep`): every
forward gathers weights from all ranks, so the ranks look at the same steps, and a rank whose rows are finished
runs idle one-token forwards (without its cache) until every rank is finished.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titanlite.errors import UserError
from titanlite.inference.sampling import Sampling, pick_tokens, prompt_seed
from titanlite.log import logger
from titanlite.models.kv_cache import KVCache

# Special tokens that end an assistant's turn in the common chat templates; those the tokenizer knows stop generation.
END_OF_TURN = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<|end▁of▁sentence|>",
    "<end_of_turn>",
    "<|end|>",
)


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos and the END_OF_TURN tokens it has as single special tokens."""
    ids = {tokenizer.eos_id}
    for name in END_OF_TURN:
        encoded = tokenizer.encode(name, bos=False, eos=False)
        if len(encoded) == 1 and tokenizer.decode(encoded) == name:
            ids.add(encoded[0])
    return sorted(ids)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] tokens, [B, T] valid) with each prompt at the right end of its row."""
    width = max(map(len, prompts))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        tokens[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        valid[row, width - len(ids) :] = True
    return tokens.to(device), valid.to(device)


def check_prompts(prompts: list[list[int]], max_seq_len: int, vocab_size: int, names: list[str]) -> None:
    """Each prompt (named names[i] in a message) fits the model: not empty, shorter than its context, its ids in its
    vocabulary."""
    for name, ids in zip(names, prompts):
        if not ids:
            raise UserError(f"{name} is empty; give every prompt at least one token")
        if len(ids) >= max_seq_len:
            raise UserError(
                f"{name} has {len(ids)} tokens, but the model's context is {max_seq_len}, which must "
                "also hold a new token; shorten the prompt"
            )
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise UserError(
                f"{name} holds token id {max(ids) if max(ids) >= vocab_size else min(ids)}, outside "
                f"the model's vocabulary of {vocab_size}; use ids from 0 to {vocab_size - 1}"
            )


def text_stop_index(ids: list[int], tokenizer, stop: tuple[str, ...], start: int) -> int | None:
    """The index of the first token of `ids` at or after `start` whose text completes a stop string (the tokens
    before `start` were checked already), None where none does."""
    if not any(s in tokenizer.decode(ids) for s in stop):  # the usual case: one decode, not one per token
        return None
    for end in range(start, len(ids)):
        text = tokenizer.decode(ids[: end + 1])
        if any(s in text for s in stop):
            return end
    return None


@dataclass(frozen=True)
class Generated:
    """One prompt's new tokens, each one's log-probability as sampled (sampling.py's pick_tokens: under
    log_softmax(logits / temperature), before top-k and top-p; greedy: temperature 1's), and why it ended:
    "eos" (a stop token, not included), "stop" (a stop string; the token completing it included, the caller cuts
    the text) or "length" (max_new_tokens or the model's context)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_token: int | None = None  # the stop token that ended it (finish_reason "eos"), left out of token_ids
    stop_logprob: float | None = None  # its log-probability as sampled (RL trains on the stop token too)


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
                out.append(Generated(ids[: text + 1], logprobs[row][: text + 1], "stop"))
            elif eos is not None:
                out.append(Generated(ids[:eos], logprobs[row][:eos], "eos", ids[eos], logprobs[row][eos]))
            else:
                out.append(Generated(ids, logprobs[row][: len(ids)], "length"))
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

        return (
            f"prefill {rate(self.prefill_tokens, self.prefill_seconds)}, "
            f"decode {rate(self.decode_tokens, self.decode_seconds)}"
        )


CHECK_EVERY = 16  # decode steps between the host's looks at the rows (stop tokens, stop strings, lockstep)


class Tokens:
    """A batch's new tokens as they are made, on the device: each row's tokens [B, W] and their log-probabilities
    [B, W] (W: the budget rounded up to 64, so that nearby budgets share one compiled step), each row's first stop
    token (eos_at [B], W = none yet), how many are made (0-dim), each row's seed (sampling.py) and the stop tokens.
    Only the token step writes them, in place."""

    def __init__(
        self, batch: int, budget: int, sampling: Sampling, seeds: list[int], stops: list[int], device: torch.device
    ):
        width = -(-budget // 64) * 64
        self.sampling = sampling
        self.new = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, width, device=device)
        self.eos_at = torch.full((batch,), width, dtype=torch.long, device=device)
        self.made = torch.zeros((), dtype=torch.long, device=device)
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        self.stops = torch.tensor([] if sampling.ignore_eos else stops, dtype=torch.long, device=device)

    def record(self, logits: torch.Tensor) -> None:
        """The next token of each row picked from its logits [B, vocab], and written down."""
        sampling, made = self.sampling, self.made
        if sampling.min_new_tokens:  # transformers' MinNewTokensLengthLogitsProcessor: no stop token before then
            held = logits.index_fill(-1, self.stops, float("-inf"))
            logits = torch.where(made < sampling.min_new_tokens, held, logits)
        picked, logprobs = pick_tokens(logits, sampling, self.seeds, made)
        self.new.index_copy_(1, made[None], picked[:, None])
        self.logprobs.index_copy_(1, made[None], logprobs[:, None])
        first = torch.isin(picked, self.stops) & (self.eos_at == self.new.shape[1])
        self.eos_at.copy_(torch.where(first, made, self.eos_at))
        self.made += 1


def token_step(model: nn.Module, cache: KVCache, tokens: Tokens) -> None:
    """One new token per row: the forward of each row's last token on the cache, the pick, the bookkeeping. The
    function `compile` compiles (and, on CUDA, CudaGraphStep replays)."""
    last = tokens.new.gather(1, (tokens.made - 1).expand(tokens.new.shape[0], 1))
    tokens.record(model(last, cache=cache.decode())[:, -1])


class CudaGraphStep:
    """The token step of one generate_ids call replayed from a CUDA graph, as gpt-fast's speed rests on: one launch
    per token instead of one per kernel. Its first call runs the step (on a side stream, as capture wants: the
    compiled kernels loaded, the allocator warm), the second captures it (capture runs nothing) and replays it, every
    later call replays it. The cache and the batch's tensors keep their memory for the call's life, and the step
    changes them in place only, so each replay is the next step."""

    def __init__(self, step, model: nn.Module, cache: KVCache, tokens: Tokens):
        self.step, self.inputs = step, (model, cache, tokens)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False

    def __call__(self) -> None:
        if self.graph is None and self.warm:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step(*self.inputs)
        if self.graph is not None:
            self.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.warm = True


def cache_capacity(width: int, budget: int) -> int:
    """Columns the cache holds: the prompts' width and the new tokens, rounded up to a multiple of 64, so that
    calls with nearby lengths share one shape (and one compiled token step)."""
    return -(-(width + budget) // 64) * 64


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_budget(prompts: list[list[int]], sampling: Sampling, max_seq_len: int) -> int:
    """max_new_tokens, or fewer where the longest prompt would pass the model's context (said once)."""
    budget = min(sampling.max_new_tokens, max_seq_len - max(map(len, prompts)))
    if budget < sampling.max_new_tokens:
        logger.info(
            f"generating at most {budget} tokens: the longest prompt and max_new_tokens would pass the model's "
            f"context of {max_seq_len}"
        )
    return budget


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    args,
    tokenizer,
    prompts: list[list[int]],
    sampling: Sampling,
    *,
    lockstep: bool = False,
    indices: list[int] | None = None,
    speed: Speed | None = None,
    step=token_step,
    cuda_graph: bool = False,
    names: list[str] | None = None,
) -> list[Generated]:
    """Each prompt's Generated, one batch: the new tokens up to (excluding) the first stop token, or up to and
    including the token that completed a stop string (the caller cuts the text), or max_new_tokens, or the model's
    context. With `lockstep`, every rank of the world calls this together.
    indices: each prompt's place among all prompts, which seeds its sampling (default 0, 1, ...); `speed`, where
    given, adds this batch's tokens and seconds; `step`: token_step, or it compiled; `cuda_graph`: replay the step
    from a CUDA graph (CudaGraphStep; a CUDA device, not in lockstep); names: what a message calls each prompt
    (default "prompts[index]").

    The tokens stay on the device while they are made: the host looks every CHECK_EVERY steps (and when the budget
    is spent), and a row finished meanwhile keeps decoding until then, its extra tokens dropped."""
    indices = list(range(len(prompts))) if indices is None else indices
    check_prompts(prompts, args.max_seq_len, args.vocab_size, names or [f"prompts[{index}]" for index in indices])
    device = next(model.parameters()).device
    budget = token_budget(prompts, sampling, args.max_seq_len)
    stops = stop_token_ids(tokenizer) if sampling.stop_ids is None else list(sampling.stop_ids)
    seeds = [prompt_seed(sampling.seed, index) for index in indices]
    started = time.perf_counter()
    ids, valid = left_padded(prompts, tokenizer.eos_id, device)
    cache = KVCache(len(prompts), cache_capacity(ids.shape[1], budget), getattr(args, "sliding_window", None), device)
    tokens = Tokens(len(prompts), budget, sampling, seeds, stops, device)
    tokens.record(model(ids, cache=cache.prefill(valid))[:, -1])
    synchronize(device)
    prefilled = time.perf_counter()
    graphed = CudaGraphStep(step, model, cache, tokens) if cuda_graph and not lockstep else None
    rows = Rows(len(prompts), tokenizer, sampling.stop)
    made, forwards, finished = 1, 0, False
    while True:
        # In lockstep every rank looks at the same forwards; alone, also when the budget is spent.
        if forwards % CHECK_EVERY == 0 or (made == budget and not lockstep):
            if rows.checked < made:
                rows.update(tokens.new[:, :made].tolist(), tokens.eos_at.tolist(), made)
            finished = finished or rows.done() or made == budget
            if all_finished(finished, lockstep, device):
                break
        if finished or made == budget:  # lockstep: this rank's share of the others' forwards
            finished = True
            idle_forward(model, device)
        else:
            graphed() if graphed is not None else step(model, cache, tokens)
            made += 1
        forwards += 1
    results = rows.results(tokens.logprobs[:, :made].tolist())
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
