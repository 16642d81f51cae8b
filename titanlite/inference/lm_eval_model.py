"""titanlite as an lm-eval 0.4 model: loglikelihood, loglikelihood_rolling and generate_until on a titanlite
model, the text split into tokens as lm-eval's own hf model splits it (no bos or eos added; an empty context is the
tokenizer's bos, which is its eos where it has none), so the two score the same tokens.

`TitanliteLM(run)` wraps a live model: an InferenceModel (model.py; python -m titanlite.eval) or the trainer's own
build.py Run (the in-loop evaluator, evaluator.py). This module imports lm-eval: it is imported only where
evaluation runs. Under data parallelism (the only layouts either allows) the ranks share the requests as lm-eval
shares them among its ranks (its rank and world size are the run's), and lm-eval gathers the per-document metrics
to rank 0. The forwards of a sharded model are collectives every rank must join: each rank pads its forwards to the
most any rank runs (idle one-token forwards), and generates in lockstep (decode.py).
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from titanlite.inference.api import LM
from titanlite.inference.decode import Sampling, idle_forward
from titanlite.inference.prompts import Prompt
from titanlite.log import Progress

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model's default where a task sets no max_gen_toks


class TitanliteLM(TemplateLM):
    def __init__(self, run, batch_size: int = 1):
        """run: an InferenceModel or build.py's Run, its model in eval mode taking tokens [B, T] to logits [B, T,
        vocab]."""
        super().__init__()
        self.lm = LM.of(run)  # generation and logits go through the Python API
        self.model, self.tokenizer, self.args = run.model, run.tokenizer, run.args
        self.batch_size = batch_size
        self.max_length = run.args.max_seq_len
        self._rank, self._world_size, self._device = run.info.rank, run.info.world_size, run.device
        self.speed = self.lm.speed  # scored sequences count as prefill

    @property
    def lockstep(self) -> bool:
        """Ranks share the requests, so a sharded model's forwards must line up across them."""
        return self._world_size > 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered) if tensor.dim() == 0 else torch.cat(gathered)

    def gather_object(self, obj, dst: int = 0):
        gathered = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, bos=bool(add_special_tokens), eos=False)

    @torch.no_grad()
    def logprobs(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """Each token sequence's [T, vocab] float32 log-probabilities of the next token, batch_size sequences per
        forward (right-padded: a causal model's earlier positions never see the padding)."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
        out: list[torch.Tensor | None] = [None] * len(windows)
        starts = range(0, len(order), self.batch_size)
        started = time.perf_counter()
        progress = Progress(len(windows), "eval: scoring", unit="sequence")  # a line every 30 s of a long task
        for start in starts:
            chunk = order[start : start + self.batch_size]
            width = len(windows[chunk[0]])
            tokens = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                tokens[row, : len(windows[i])] = torch.tensor(windows[i])
            logits = self.lm.logits(tokens)
            for row, i in enumerate(chunk):
                out[i] = F.log_softmax(logits[row, : len(windows[i])].float(), dim=-1).cpu()
            progress.advance(len(chunk))
        self.speed.prefill_tokens += sum(map(len, windows))
        self.speed.prefill_seconds += time.perf_counter() - started  # .cpu() waited for the forwards
        self.pad_forwards(len(starts))
        return out

    def pad_forwards(self, ran: int) -> None:
        """In lockstep, idle forwards until every rank has run as many as the rank that ran the most."""
        if not self.lockstep:
            return
        most = torch.tensor([ran], device=self._device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        for _ in range(int(most.item()) - ran):
            idle_forward(self.model, self._device)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether each of its tokens is the most likely one), with
        the context cut from the left to fit max_length as lm-eval's hf model cuts it."""
        windows, continuations = [], []
        for _, context, continuation in requests:
            windows.append((context + continuation)[-(self.max_length + 1) :][:-1])
            continuations.append(continuation)
        results = []
        for logprobs, continuation in zip(self.logprobs(windows), continuations):
            scored = logprobs[-len(continuation) :]
            target = torch.tensor(continuation)
            total = scored.gather(-1, target[:, None]).sum().item()
            results.append((total, bool((scored.argmax(dim=-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood over max_length windows, as lm-eval's hf model computes it."""
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, context, target) for context, target in windows])
            totals.append(sum(score for score, _ in scores))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation (decode.py), ended by the task's `until` strings or the eos token and cut
        before them; contexts left-truncated to leave room for max_gen_toks, as lm-eval's hf model does."""
        eos = self.tokenizer.decode([self.eot_token_id])
        results = []
        progress = Progress(len(requests), "eval: generating", unit="request")
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            sampling = Sampling(
                max_new,
                float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                float(kwargs.get("top_p", 1.0)),
                int(kwargs.get("top_k", 0) or 0),
                stop=tuple(until),
                stop_ids=(self.eot_token_id,),
            )
            new = self.lm.complete([Prompt(context, ids)], sampling, lockstep=self.lockstep)[0].token_ids
            results.append(postprocess_generated_text(self.tokenizer.decode(new), until, None))
            progress.advance()
        return results
