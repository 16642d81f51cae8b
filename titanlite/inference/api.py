"""The Python API: `titanlite.load(path)` gives an `LM` that generates and scores.

    lm = titanlite.load("runs/my_run")  # a Hugging Face folder, a checkpoint step-N folder or a run's dump folder
    [completion] = lm.generate(["Once upon a time"], max_new_tokens=32)
    completion.text, completion.token_ids, completion.logprobs, completion.finish_reason

The model is the one python -m titanlite.generate builds (model.py: the [model] section's, its weights through the
checked loader). Prompts are rendered as training renders them (prompts.py), completion i is sampled from (seed, i)
alone (decode.py), and the decode loop runs on the static KV cache (models/kv_cache.py), with its decode step
compiled where `compile` says so. python -m titanlite.generate (generate_job.py) and the lm-eval model
(lm_eval_model.py) are layers over `LM`.

Process group: building the model needs one (its device mesh); generating and scoring in one process do not (no
collective runs). load() in a process without one opens a 1-rank gloo group on an in-memory store (no port, no
environment variables) for the build and closes it after, leaving the process as it was; a process that already
has a 1-rank group keeps it. A group of more ranks is refused: sharded generation runs in lockstep under torchrun
through python -m titanlite.generate.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.inference.decode import Sampling, Speed, decode_step, generate_ids
from titanlite.inference.model import build_inference_model
from titanlite.inference.prompts import Prompt, checked_record, completion_text, render_prompts
from titanlite.parallel.dist import DistInfo, close_distributed, init_distributed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Completion:
    prompt: str  # the prompt as the model saw it, as text
    prompt_token_ids: list[int]
    text: str  # the new tokens as text, cut before a stop string
    token_ids: list[int]  # the new tokens (a stop token left out; the one completing a stop string kept)
    logprobs: list[float]  # each new token's log-probability under the model at temperature 1
    finish_reason: str  # "eos" (a stop token), "stop" (a stop string) or "length" (max_new_tokens or the context)


class LM:
    def __init__(self, run, compile: bool = False):
        """run: an InferenceModel (model.py) or build.py's Run; compile: torch.compile the decode step (one compiled
        graph per batch size and cache length, the first call of each paying the compilation)."""
        self.run, self.model, self.tokenizer, self.args = run, run.model, run.tokenizer, run.args
        self.device = run.info.device
        self.speed = Speed()  # every call's prefill and decode tokens and seconds, added up
        self.step = compiled_step(self.device) if compile else decode_step

    def render(self, prompts: list) -> list[Prompt]:
        """Each prompt (a str, a list of {"role", "content"} messages or a list of token ids) as training renders it:
        text after the tokenizer's bos, messages through the chat template with the generation prompt, ids as given."""
        if (isinstance(prompts, (str, dict)) or not isinstance(prompts, (list, tuple))
                or any(isinstance(p, (int, dict)) for p in prompts)):
            raise UserError("generate takes a list of prompts (each a string, a list of messages or a list of token ids); "
                            "wrap a single prompt in a list")
        records = []
        for number, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                kind = "prompt"
            elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
                kind = "messages"
            else:
                kind = "token_ids"
            records.append(checked_record({kind: list(prompt) if isinstance(prompt, tuple) else prompt}, f"prompts[{number}]"))
        return render_prompts(records, self.tokenizer, self.run.cfg.training.chat_template)

    def generate(self, prompts: list, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop: list[str] | None = None,
                 batch_size: int | None = None) -> list[Completion]:
        """One Completion per prompt, in order. temperature 0 = greedy; stop: strings that end a completion (the
        tokenizer's eos and end-of-turn tokens always do); batch_size: prompts per batch (None = all at once).
        Completion i depends on (seed, i, its prompt) alone, never on batch_size or the other prompts."""
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed, batch_size)
        sampling = Sampling(max_new_tokens, float(temperature), float(top_p), int(top_k), seed, tuple(stop or ()))
        return self.complete(self.render(prompts), sampling, batch_size)

    def complete(self, prompts: list[Prompt], sampling: Sampling, batch_size: int | None = None,
                 lockstep: bool = False) -> list[Completion]:
        """The rendered prompts' completions in batches of batch_size (None = one batch); `lockstep`: every rank of the
        world calls this together (decode.py)."""
        size = batch_size or len(prompts)
        completions = []
        for start in range(0, len(prompts), size):
            batch = prompts[start:start + size]
            generated = generate_ids(self.model, self.args, self.tokenizer, [p.ids for p in batch], sampling,
                                     lockstep=lockstep, indices=list(range(start, start + len(batch))), speed=self.speed,
                                     step=self.step)
            completions += [Completion(p.text, p.ids, completion_text(g.token_ids, self.tokenizer, sampling.stop),
                                       g.token_ids, g.logprobs, g.finish_reason) for p, g in zip(batch, generated)]
        return completions

    @torch.no_grad()
    def logits(self, token_ids) -> torch.Tensor:
        """The model's next-token logits, float32, on the model's device: a list of ids [T] -> [T, vocab]; a list of
        equally long lists or a [B, T] tensor -> [B, T, vocab]. Nothing is added to the ids."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long) if not isinstance(token_ids, torch.Tensor) else token_ids
        if tokens.dim() not in (1, 2) or tokens.numel() == 0:
            raise UserError("logits takes a non-empty list of token ids, or a [batch, length] tensor of them")
        if tokens.shape[-1] > self.args.max_seq_len:
            raise UserError(f"logits got {tokens.shape[-1]} tokens, but the model's context is {self.args.max_seq_len}; "
                            "shorten them")
        if tokens.min() < 0 or tokens.max() >= self.args.vocab_size:
            raise UserError(f"logits got token ids outside the model's vocabulary of {self.args.vocab_size}; use ids from "
                            f"0 to {self.args.vocab_size - 1}")
        batch = tokens if tokens.dim() == 2 else tokens[None]
        out = self.model(batch.to(self.device)).float()
        return out if tokens.dim() == 2 else out[0]


def compiled_step(device: torch.device):
    """decode_step under torch.compile. On the CPU inductor freezes the weights (folds them in as constants, its
    linears prepacked for MKL: the decode step's matrix multiplies are then faster than eager's) and calls its
    kernels from C++ (cpp_wrapper: no Python call per kernel, 5-10% at batch 1 here), the linears that read the same
    input (q, k, v; gate and up) concatenated into one (about 5% at batch 1). These are read from inductor's
    config when a graph is compiled, which happens inside a call (torch.compile's `options` do not reach freezing),
    hence the patch around each call. A frozen step keeps the weights of its first call: an LM whose
    weights change afterwards (training between calls) needs compile=False or a new LM; so dynamo is told not to
    guard on the model's modules either (their checks cost about 200 us a step at batch 1 here, 4%)."""
    if device.type != "cpu":
        return torch.compile(decode_step, fullgraph=True)
    step = torch.compile(decode_step, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    from torch._inductor import config

    def frozen(model, cache, tokens):
        with config.patch({"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True}):
            return step(model, cache, tokens)

    return frozen


def check_sampling(max_new_tokens, temperature, top_p, top_k, seed, batch_size) -> None:
    """The generate arguments the [generate] section also checks, one sentence each."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise UserError(f"max_new_tokens={max_new_tokens!r}: give a whole number of at least 1")
    if temperature < 0:
        raise UserError(f"temperature={temperature}: give 0 (greedy) or more")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p}: give a value above 0 and at most 1 (1 = every token)")
    if top_k < 0:
        raise UserError(f"top_k={top_k}: give 0 (every token) or more")
    if not 0 <= seed < 2**32:
        raise UserError(f"seed={seed}: give a whole number from 0 to 2**32 - 1")
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
        raise UserError(f"batch_size={batch_size!r}: give a whole number of at least 1, or None for one batch")


def config_argv(path: Path) -> list[str]:
    """The config flags that build the model `path` holds: a Hugging Face folder (config.json), a checkpoint step-N
    folder (its run's config.toml two folders up, the weights of that step) or a run's dump folder (config.toml; the
    weights of its newest complete checkpoint, as a resume takes them)."""
    if (path / "config.json").is_file():
        return ["--model.hf_assets_path", str(path)]
    run = path.parent.parent
    if path.name.startswith("step-") and (run / "config.toml").is_file():
        return ["--job.config_file", str(run / "config.toml"), "--job.dump_folder", str(run),
                "--generate.checkpoint", str(path)]
    if (path / "config.toml").is_file():
        return ["--job.config_file", str(path / "config.toml"), "--job.dump_folder", str(path)]
    raise UserError(f"titanlite.load({str(path)!r}): that is neither a Hugging Face model folder (config.json), a "
                    "checkpoint step-N folder of a run nor a run's dump folder (config.toml); give one of those")


def weights_dtype(path: Path) -> str | None:
    """The dtype of a Hugging Face folder's first floating-point safetensors weight, as training.param_dtype names it;
    None where there is none (a run's weights are in its own training.param_dtype)."""
    files = sorted(path.glob("*.safetensors")) if (path / "config.json").is_file() else []
    for file in files:
        with open(file, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__" and entry["dtype"] in ("F32", "BF16", "F16"):
                return SAFETENSORS_DTYPES.get(entry["dtype"], "float32")  # float16 weights are held in float32
    return None


def dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UserError(f"dtype={dtype!r}: titanlite holds weights in float32 or bfloat16; give torch.float32, "
                        "torch.bfloat16, or None for the weights' own")
    return name


def process_group(device: str) -> DistInfo:
    """This process's place: a 1-rank group opened where none is (the caller closes it; module docstring)."""
    if not dist.is_initialized():
        return init_distributed(device, 60)
    if dist.get_world_size() > 1:
        raise UserError(f"titanlite.load runs in one process, but this one is rank {dist.get_rank()} of "
                        f"{dist.get_world_size()}; generate on several ranks with torchrun ... -m titanlite.generate")
    gpu = device != "cpu" and torch.cuda.is_available()
    return DistInfo(0, 1, torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu"))


def load(path, compile: bool = False, dtype=None, device: str = "auto") -> LM:
    """The model at `path` (config_argv), ready to generate. dtype: torch.float32 or torch.bfloat16, None = the
    weights' own; device: auto (CUDA where a GPU is visible), cuda or cpu; compile: torch.compile the decode step."""
    path, name = Path(path).expanduser(), dtype_name(dtype)
    argv = config_argv(path) + ["--job.device", device]
    name = name or weights_dtype(path)
    if name:
        argv += ["--training.param_dtype", name]
    cfg = load_config(argv)
    opened = not dist.is_initialized()
    try:
        loaded = build_inference_model(cfg, process_group(device))
    finally:
        if opened:  # one process's model runs no collective: the process is left as it was
            close_distributed()
    return LM(loaded, compile=compile)
