"""The Python API: `titanlite.load(path)` (load.py) gives an `LM` that generates and scores.

    lm = titanlite.load("runs/my_run")  # a Hugging Face folder, a checkpoint step-N folder or a run's dump folder
    [completion] = lm.generate(["Once upon a time"], max_new_tokens=32)
    completion.text, completion.token_ids, completion.logprobs, completion.finish_reason

Prompts are rendered as training renders them (prompts.py), completion i is sampled from (seed, i) alone
(decode.py), and the decode loop runs on the static KV cache (models/kv_cache.py), its token step compiled where
`compile` says so. python -m titanlite.generate, the lm-eval model (lm_eval_model.py) and the in-loop evaluator's
samples are layers over `LM` (LM.of: a job's model, sharded under torchrun).
"""

import types
from dataclasses import dataclass

import torch

from titanlite.errors import UserError
from titanlite.inference.arguments import check_batch_size, checked_logits_ids, checked_prompts, checked_sampling
from titanlite.inference.decode import Sampling, Speed, generate_ids, token_step
from titanlite.inference.prompts import Prompt, checked_record, completion_text, render_prompts
from titanlite.log import Progress


@dataclass(frozen=True)
class Completion:
    prompt: str  # the prompt as the model saw it, as text
    prompt_token_ids: list[int]
    text: str  # the new tokens as text, cut before a stop string
    token_ids: list[int]  # the new tokens (a stop token left out; the one completing a stop string kept)
    logprobs: list[float]  # each new token's log-probability as sampled: under log_softmax(logits / temperature)
    # before top-k and top-p (greedy: temperature 1's)
    finish_reason: str  # "eos" (a stop token), "stop" (a stop string) or "length" (max_new_tokens or the context)


class LM:
    def __init__(self, model, args, tokenizer, device: torch.device, chat_template: str = "", compile: bool = False):
        """model: a decoder in eval mode (whole, or FSDP-sharded under torchrun), args its model args, tokenizer its
        tokenizer; chat_template: a template file for prompts given as messages, "" = the tokenizer folder's own;
        compile: torch.compile the token step (one compiled graph per batch size and cache length, the first call of
        each paying the compilation; on CUDA the step is also captured as a CUDA graph)."""
        self.model, self.args, self.tokenizer, self.device = model, args, tokenizer, device
        self.chat_template = chat_template
        self.speed = Speed()  # every call's prefill and decode tokens and seconds, added up
        self.step = compiled_step(device) if compile else token_step
        self.cuda_graph = compile and device.type == "cuda"  # the compiled step replayed from a CUDA graph

    @classmethod
    def of(cls, run, compile: bool = False) -> "LM":
        """The LM of a job's model: model.py's InferenceModel or build.py's Run (the in-loop evaluator's live model),
        prompts given as messages rendered with its training.chat_template."""
        return cls(run.model, run.args, run.tokenizer, run.info.device, run.cfg.training.chat_template, compile)

    def render(self, prompts: list) -> list[Prompt]:
        """Each prompt (a str, a list of {"role", "content"} messages or a list of token ids) as training renders it:
        text after the tokenizer's bos, messages through the chat template with the generation prompt, ids as given."""
        records = []
        for number, prompt in enumerate(checked_prompts(prompts)):
            if isinstance(prompt, str):
                kind = "prompt"
            elif prompt and all(isinstance(m, dict) for m in prompt):
                kind = "messages"
            else:
                kind = "token_ids"
            records.append(checked_record({kind: prompt}, f"prompts[{number}]"))
        return render_prompts(records, self.tokenizer, self.chat_template)

    def generate(
        self,
        prompts: list,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: list[str] | str | None = None,
        batch_size: int | None = None,
        *,
        min_new_tokens: int = 0,
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """One Completion per prompt, in order. temperature 0 = greedy; stop: strings that end a completion (the
        tokenizer's eos and end-of-turn tokens always do, unless ignore_eos); batch_size: prompts per batch (None = all
        at once); min_new_tokens: no stop token before that many new tokens; ignore_eos: the stop tokens end nothing
        (transformers' meanings). Completion i depends on (seed, i, its prompt) alone, never on batch_size or the
        other prompts."""
        sampling = checked_sampling(
            max_new_tokens, temperature, top_p, top_k, seed, stop, min_new_tokens=min_new_tokens, ignore_eos=ignore_eos
        )
        check_batch_size(batch_size)
        return self.complete(self.render(prompts), sampling, batch_size)

    def complete(
        self, prompts: list[Prompt], sampling: Sampling, batch_size: int | None = None, lockstep: bool = False
    ) -> list[Completion]:
        """The rendered prompts' completions in batches of batch_size (None = one batch); `lockstep`: every rank of the
        world calls this together (decode.py)."""
        size = batch_size or len(prompts)
        completions = []
        progress = Progress(len(prompts), "generate", unit="prompt")  # a line every 30 s of a long job
        for start in range(0, len(prompts), size):
            batch = prompts[start : start + size]
            indices = list(range(start, start + len(batch)))
            generated = generate_ids(
                self.model,
                self.args,
                self.tokenizer,
                [p.ids for p in batch],
                sampling,
                lockstep=lockstep,
                indices=indices,
                speed=self.speed,
                step=self.step,
                cuda_graph=self.cuda_graph,
                names=[p.where or f"prompts[{i}]" for p, i in zip(batch, indices)],
            )
            completions += [
                Completion(
                    p.text,
                    p.ids,
                    completion_text(g.token_ids, self.tokenizer, sampling.stop),
                    g.token_ids,
                    g.logprobs,
                    g.finish_reason,
                )
                for p, g in zip(batch, generated)
            ]
            progress.advance(len(batch))
        return completions

    @torch.no_grad()
    def logits(self, token_ids) -> torch.Tensor:
        """The model's next-token logits, float32, on the model's device: a list of ids [T] -> [T, vocab]; a list of
        equally long lists (or a [B, T] integer tensor or array) -> [B, T, vocab]. Nothing is added to the ids."""
        tokens = torch.tensor(checked_logits_ids(token_ids), dtype=torch.long)
        if tokens.shape[-1] > self.args.max_seq_len:
            raise UserError(
                f"logits got {tokens.shape[-1]} tokens, but the model's context is {self.args.max_seq_len}; "
                "shorten them"
            )
        if tokens.min() < 0 or tokens.max() >= self.args.vocab_size:
            raise UserError(
                f"logits got token ids outside the model's vocabulary of {self.args.vocab_size}; use ids from "
                f"0 to {self.args.vocab_size - 1}"
            )
        batch = tokens if tokens.dim() == 2 else tokens[None]
        out = self.model(batch.to(self.device)).float()
        return out if tokens.dim() == 2 else out[0]


def compiled_step(device: torch.device):
    """token_step (the forward, the pick and the bookkeeping of one token per row) under torch.compile, a copy of its
    own for each LM (own_copy). On the CPU inductor freezes the weights (folds them in as constants, its
    linears prepacked for MKL: the step's matrix multiplies are then faster than eager's) and calls its
    kernels from C++ (cpp_wrapper: no Python call per kernel, 5-10% at batch 1 here), the linears that read the same
    input (q, k, v; gate and up) concatenated into one (about 5% at batch 1). These are read from inductor's
    config when a graph is compiled, which happens inside a call (torch.compile's `options` do not reach freezing),
    hence the patch around each call. A frozen step keeps the weights of its first call: an LM whose
    weights change afterwards (training between calls) needs compile=False or a new LM; so dynamo is told not to
    guard on the model's modules either (their checks cost about 200 us a step at batch 1 here, 4%)."""
    if device.type != "cpu":
        return torch.compile(own_copy(token_step), fullgraph=True)
    step = torch.compile(
        own_copy(token_step),
        fullgraph=True,
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )
    from torch._inductor import config

    def frozen(model, cache, tokens):
        with config.patch({"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True}):
            return step(model, cache, tokens)

    return frozen


def own_copy(function):
    """`function` with a code object of its own. Dynamo keeps compiled graphs per code object, and without guards on
    the model (above) a second LM of the same shapes would run the first one's graph, its frozen weights included."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
