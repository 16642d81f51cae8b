"""RL's generation seam: a `RolloutEngine` turns prompt ids into completions, each with the sampler's log-probability
of every sampled token (at the sampling temperature) and the policy step whose weights sampled it, and is told of new
weights after each optimizer step (`update_weights`). The rollout stage (rl/rollout.py) knows engines only through
this protocol; docs/design.md says how a vLLM engine would be one more class.

`ColocatedEngine`, the default, generates on the training ranks. A policy sharded by FSDP would all-gather every
block's weights at each decoded token; instead the engine gathers the whole policy once per rollout batch into a plain
unsharded copy in the precision FSDP computes in (`gathered_policy`), decodes on it with no collective at all, and
frees it. Under TP (with FSDP or not) only FSDP's dimension is gathered: the copy keeps each rank's TP shards
(`tp_copy`), laid out by the family's TP plan without sequence parallelism (parallel/tp.py's decode_style), so each
rank of a TP group holds only its heads' keys and values in the KV cache, and the decode's collectives are TP's own
per layer (the row-wise projections' all-reduce, the logits' all-gather) and the stop flag's, agreed every
CHECK_EVERY tokens. Under EP the copy is whole, every expert gathered. An unsharded policy (one process) decodes as
it is. Where the ranks of a TP group may call the model a different number of times (an agent's turns, held()) or
while training runs collectives on the same ranks (submit(), rl.max_staleness), the copy is whole: a decode with
collectives would wait for a partner that never comes.
"""

import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlite.dtypes import DTYPES
from titanlite.inference.decode import CHECK_EVERY, Generated, Sampling, generate_ids
from titanlite.models.construct import meta_model
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.tp import tp_shard


@dataclass(frozen=True)
class Completion:
    """One completion as sampled: its tokens up to a stop token (left out of `ids`, kept in `stop_token`), the
    sampler's log-probability of each sampled token, stop token included, and the policy that sampled it."""

    ids: list[int]
    stop_token: int | None  # the stop token that ended it; None: cut at max_new_tokens (or by a stop string)
    finish_reason: str  # inference/decode.py's Generated: "eos", "stop" or "length"
    logprobs: list[float]  # log_softmax(logits / temperature) at each token of sampled_ids, before top-k/top-p
    policy_step: int  # optimizer steps the sampling weights had taken (0 = the initial policy)

    @property
    def sampled_ids(self) -> list[int]:
        """The tokens as sampled, with the stop token that ended the completion."""
        return self.ids + ([self.stop_token] if self.stop_token is not None else [])


class RolloutStopped(Exception):
    """A stop signal ended generation before its end: the rollout batch holds nothing to train on or to save."""


class RolloutEngine(Protocol):
    stopping: Callable[[], bool]  # checked at every decoded token: True ends generate() with RolloutStopped

    def generate(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> list[Completion]:
        """Completions of `prompts`; indices[i] is prompt i's place among all completions (seeds its sampling)."""

    def submit(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> Future:
        """generate() in the background, by the weights of now: a Future of its completions."""

    def update_weights(self, policy_step: int) -> None:
        """The policy has taken `policy_step` optimizer steps: later completions are sampled by those weights."""


class Stoppable(nn.Module):
    """The sampler's model, ending the decode at its next token once the trainer's stop flag is up (a SIGTERM during a
    rollout: an unfinished rollout holds nothing to save). A model sharded over `group` (tp_copy) stops only where
    the group agrees, every CHECK_EVERY forwards: a rank leaving alone would leave its partners waiting in the next
    layer's all-reduce."""

    def __init__(self, model: nn.Module, stopping: Callable[[], bool], group=None):
        super().__init__()
        self.model, self.stopping, self.group = model, stopping, group
        self.forwards = 0

    def forward(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.stopped(tokens.device):
            raise RolloutStopped
        return self.model(tokens, **kwargs)

    def stopped(self, device: torch.device) -> bool:
        if self.group is None:
            return self.stopping()
        self.forwards += 1
        if (self.forwards - 1) % CHECK_EVERY:  # the group's ranks make the same forwards: they agree at the same ones
            return False
        flag = torch.tensor([float(self.stopping())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def plain_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper: the unwrapped model's name."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if parameter:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def whole(param: torch.Tensor) -> torch.Tensor:
    """`param` as full_copy() holds it: each DTensor's full_tensor() (one all-gather over FSDP's, TP's and EP's
    ranks), a plain tensor cloned (FSDP leaves a block it did not reshard after its last forward unsharded until
    backward)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def copy_of_policy(run, copy: nn.Module, value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> nn.Module:
    """`copy` (the policy built anew on the meta device, in eval mode) holding value(the policy's parameter, the
    copy's), its buffers shared; under FSDP cast to training.mixed_precision_param as FSDP casts it for compute,
    otherwise in the dtype it trains in (autocast casts it as it casts the policy)."""
    policy = run.model
    cast = DTYPES[run.cfg.training.mixed_precision_param] if isinstance(policy, FSDPModule) else None
    with torch.no_grad():
        for name, p in policy.named_parameters():
            name = plain_name(name)
            held = value(p, copy.get_parameter(name))
            set_tensor(copy, name, held.to(cast) if cast is not None else held, parameter=True)
    for name, buffer in policy.named_buffers():
        set_tensor(copy, plain_name(name), buffer, parameter=False)
    if getattr(run.args, "tie_embeddings", False):  # one matrix: the output reads the embedding's copy
        copy.output.weight = copy.tok_embeddings.weight
    return copy


def full_copy(run) -> nn.Module:
    """A plain copy of the policy's whole weights: decodes with no collective at all."""
    copy = meta_model(run.spec, run.args, run.cfg.training.param_dtype, run.cfg.lora).eval()
    return copy_of_policy(run, copy, lambda param, _: whole(param))


def tp_copy(run) -> nn.Module:
    """A copy of the policy under TP that keeps this rank's TP shards (FSDP's dimension gathered, parallel/tp.py's
    tp_shard), laid out by the family's TP plan without sequence parallelism: a decode step's one token per row is
    whole on every rank of the TP group, which holds only its own heads' keys and values."""
    copy = meta_model(run.spec, run.args, run.cfg.training.param_dtype, run.cfg.lora).eval()
    run.spec.apply_tp(copy, run.dims, loss_parallel=False, sequence_parallel=False)

    def shard(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return tp_shard(param, like) if isinstance(like, DTensor) else whole(param)

    return copy_of_policy(run, copy, shard)


@contextlib.contextmanager
def gathered_policy(run, sharded: bool = True):
    """The policy to decode with now: sharded (FSDP, TP, EP) a copy gathered once, freed on exit (under TP and
    `sharded`, tp_copy(): the group's ranks decode its completions together, each with its heads; else full_copy()),
    otherwise the policy itself, in eval mode for the while."""
    policy = run.model
    if any(isinstance(p, DTensor) for p in policy.parameters()) or isinstance(policy, FSDPModule):
        copy = tp_copy(run) if sharded and run.dims.tp_enabled else full_copy(run)
        try:
            yield copy
        finally:
            del copy
        return
    was_training = policy.training
    policy.eval()  # dropout off; MoE's routing statistics count training forwards only
    try:
        yield policy
    finally:
        policy.train(was_training)


class ColocatedEngine:
    """Generation on the training ranks with the training policy itself: its weights are read when a rollout batch
    is generated (gathered once under FSDP), so new weights need no transfer. `submit` takes a full_copy() of them
    now and decodes it on a thread of its own while training goes on (rl.max_staleness)."""

    def __init__(self, run):
        self.run = run
        self.policy_step = 0
        self.stopping: Callable[[], bool] = lambda: False  # the trainer's stop signal (train.py)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self.model: nn.Module | None = None  # the weights held for several generate() calls (held())

    @contextlib.contextmanager
    def held(self):
        """generate() calls within decode one copy of the weights, gathered once on entry (every rank enters
        together): an agent's turns, whose number differs between ranks (rl/episode.py), maybe even within a TP group
        (a tool's timeout), so the copy is whole."""
        with gathered_policy(self.run, sharded=False) as model:
            self.model = model
            try:
                yield
            finally:
                self.model = None

    def update_weights(self, policy_step: int) -> None:
        self.policy_step = policy_step

    def generate(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> list[Completion]:
        # compile.enable compiles the blocks for training's shapes; a decode step per token through them would
        # recompile past dynamo's limit (every cache length is a new shape), so decoding runs them eagerly.
        weights = contextlib.nullcontext(self.model) if self.model is not None else gathered_policy(self.run)
        with weights as model, torch.compiler.set_stance("force_eager"):
            return self.sample(model, prompts, sampling, indices, self.policy_step)

    def submit(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> Future:
        """generate()'s completions, made in the background from the weights as they are now (submit_turns, one
        turn)."""
        return self.submit_turns(lambda generate: generate(prompts, sampling, indices))

    def decode(
        self, model: nn.Module, prompts: list[list[int]], sampling: Sampling, indices: list[int], policy_step: int
    ) -> list[Completion]:
        run = self.run
        with mixed_precision_context(run.dims, run.cfg.training.mixed_precision_param, run.device.type):  # per thread
            return self.sample(model, prompts, sampling, indices, policy_step)

    def sample(
        self, model: nn.Module, prompts: list[list[int]], sampling: Sampling, indices: list[int], policy_step: int
    ) -> list[Completion]:
        """The completions `model` samples; a TP copy's group agrees on the stop flag (Stoppable)."""
        run = self.run
        group = tp_group(model)
        generated = generate_ids(
            Stoppable(model, self.stopping, group), run.args, run.tokenizer, prompts, sampling, indices=indices
        )
        return [completion(g, policy_step) for g in generated]

    def submit_turns(self, job: Callable[[Callable[..., list[Completion]]], list]) -> Future:
        """job(generate) on the engine's thread, by the weights as they are now: generate(prompts, sampling, indices)
        decodes one full_copy() of them, taken here, as many times as the job asks: once for submit(), each turn of an
        agent's episodes sampled ahead (rl.max_staleness; its tool calls run on that thread too)."""
        return self.pool.submit(job, functools.partial(self.decode, full_copy(self.run), policy_step=self.policy_step))


def tp_group(model: nn.Module):
    """The process group a tp_copy() is sharded over; None for a model whose decode has no collective."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def completion(generated: Generated, policy_step: int) -> Completion:
    """The engine's Completion of decode.py's Generated: the sampler's log-probabilities (log_softmax(logits /
    temperature) of the very logits each token was drawn from, before top-k and top-p) with the stop token's."""
    stop = generated.stop_token if generated.finish_reason == "eos" else None
    logprobs = generated.logprobs + ([generated.stop_logprob] if stop is not None else [])
    return Completion(generated.token_ids, stop, generated.finish_reason, logprobs, policy_step)
