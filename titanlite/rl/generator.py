"""Generator ranks (rl.generator_ranks N): the launch's last N ranks only generate, the first W - N train.

The trainers' default process group is the trainers' world (parallel/dist.py's split_world), so the mesh, FSDP, the
metrics, DCP and the rollout stage's reward gathers run over the trainers as ever; only the engine differs. The
trainers' `GeneratorEngine` sends each request (a trainer's prompts, sampling and seed indices, decoded as one batch,
as the colocated engine decodes them) through the launch's store to generator t % N, which answers with the
completions (rl/generator_rank.py). Before the first request that needs newer weights, every trainer gathers the
whole policy (full_copy: one all-gather per parameter over the trainers) and trainer 0 broadcasts it to the
generators in a group of their own (gloo on the CPU, NCCL on GPUs), timed as `rl/weight_sync_seconds`. The schedule is
the stage's (rl/ahead.py), so generator ranks give the colocated run at every rl.max_staleness.

The store's keys, under the run's prefix: request/<trainer>/<round> and reply/<trainer>/<round> (pickled; each
deleted by its reader), manifest (the weights' names, shapes and dtypes, once, read by every generator), stop (set
by every trainer as its run ends, however it ends: the generators then exit).
"""

import contextlib
import pickle
import time

import torch

from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.inference.decode import Sampling
from titanlite.parallel.dims import ParallelDims
from titanlite.rl.engine import Completion, RolloutStopped, full_copy
from titanlite.rl.rollout import RolloutStage

POLL_SECONDS = 0.005  # how often a waiting side looks at the store (and at its stop flag)
STOPPED = "stopped"  # a generator's reply when a stop signal ended the decode


def check_generator_ranks(cfg: JobConfig, world_size: int) -> None:
    """rl.generator_ranks against the launch's processes: trainers left, each generator with a trainer to serve,
    and the trainers' world split by the parallelism degrees."""
    count = cfg.rl.generator_ranks
    if not count:
        return
    trainers = world_size - count
    if trainers < 1:
        raise UserError(
            f"rl.generator_ranks {count} leaves none of the {world_size} processes to train; launch more processes "
            f"(torchrun --nproc_per_node) or lower rl.generator_ranks below {world_size}"
        )
    if count > trainers:
        raise UserError(
            f"rl.generator_ranks {count} is more than the {trainers} trainer ranks it leaves (generator g serves "
            f"trainers t with t % {count} == g, so some would serve none); lower it to at most {trainers}"
        )
    try:
        ParallelDims.from_config(cfg.parallelism, trainers)
    except UserError as error:
        raise UserError(
            f"rl.generator_ranks {count} leaves {trainers} of {world_size} processes to train: {error}"
        ) from None


def fetch(store, key: str, stopped, keep: bool = False) -> object | None:
    """The pickled value at `key`, deleted once read unless `keep` (a key every generator reads); None once
    `stopped()` says to give up waiting."""
    while not store.check([key]):
        if stopped():
            return None
        time.sleep(POLL_SECONDS)
    value = pickle.loads(store.get(key))
    if not keep:
        store.delete_key(key)
    return value


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as bytes: what the weights group broadcasts, whatever the dtype (gloo's types or not)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class Reply:
    """A request's completions, waited for in result(); RolloutStopped once the trainer's stop flag is up (the
    generator decodes on until the run's stop key) or where the generator's own stop signal ended the decode."""

    def __init__(self, store, key: str, engine: "GeneratorEngine"):
        self.store, self.key, self.engine = store, key, engine

    def result(self) -> list[Completion]:
        completions = fetch(self.store, self.key, lambda: self.engine.stopping())
        if completions is None or completions == STOPPED:
            raise RolloutStopped
        return completions


class GeneratorEngine:
    """RolloutEngine on the trainers of rl.generator_ranks: requests to the generators, new weights sent to them
    with the first request that needs them (every trainer takes part in the gather; trainer 0 sends)."""

    def __init__(self, run):
        self.run, self.link = run, run.info.generators
        self.store, self.trainer = self.link.run_store, run.info.rank
        self.stopping = lambda: False  # the trainer's stop signal (train.py)
        self.policy_step, self.synced = 0, None  # the steps of the weights to sample by, of those the generators hold
        self.rounds = 0  # requests sent, numbering them (every trainer sends the same sequence)
        self.group = None  # trainer 0's weights group, made at the first send
        self.sync_seconds = 0.0  # since the last take_sync_seconds()

    def update_weights(self, policy_step: int) -> None:
        self.policy_step = policy_step

    def generate(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> list[Completion]:
        return self.submit(prompts, sampling, indices).result()

    def submit(self, prompts: list[list[int]], sampling: Sampling, indices: list[int]) -> Reply:
        """The request sent now, sampled by the weights of now: where the generators hold older ones, trainer 0
        sends them after its request, which tells its generator to take them."""
        began, copy = time.perf_counter(), None
        if self.synced != self.policy_step:
            copy = full_copy(self.run)  # every trainer: the gathers are collectives of the trainers
        key = f"{self.trainer}/{self.rounds}"
        self.rounds += 1
        self.store.set(f"request/{key}", pickle.dumps((prompts, sampling, indices, self.policy_step)))
        if copy is not None:
            if self.trainer == 0:
                self.send_weights(copy)
            del copy
            self.synced = self.policy_step
            self.sync_seconds += time.perf_counter() - began
        return Reply(self.store, f"reply/{key}", self)

    def send_weights(self, copy) -> None:
        """The whole policy broadcast to the generators in the dtypes it decodes in, parameters then buffers, as they
        build them from the manifest (sent first, with the weights group made, at the first send)."""
        parameters = list(copy.named_parameters())
        tensors = parameters + list(copy.named_buffers())
        if self.group is None:
            manifest = [(name, tuple(t.shape), t.dtype, i < len(parameters)) for i, (name, t) in enumerate(tensors)]
            self.store.set("manifest", pickle.dumps(manifest))
            self.group = self.link.weights_group()
        for _, tensor in tensors:
            self.group.broadcast(as_bytes(tensor.contiguous()), 0).wait()

    def take_sync_seconds(self) -> float:
        seconds, self.sync_seconds = self.sync_seconds, 0.0
        return seconds


class GeneratorStage(RolloutStage):
    """The rollout stage fed by generator ranks: each rollout batch's statistics add the weights' sync time since
    the batch before (rl/weight_sync_seconds)."""

    def made(self, *args):
        rollouts = super().made(*args)
        rollouts.stats["rl/weight_sync_seconds"] = self.engine.take_sync_seconds()
        return rollouts


@contextlib.contextmanager
def trainers_run(info):
    """A trainer's run under rl.generator_ranks: its keys' prefix begun, and the generators told to stop as it ends,
    whatever ends it (a refusal before step 1 included)."""
    if info.generators is None:
        yield
        return
    store = info.generators.begin_run()
    try:
        yield
    finally:
        store.set("stop", "1")
