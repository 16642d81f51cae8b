"""Fault tolerance on torchft: replica groups that train on when one of them is lost.

Each replica group is one titanlite job (plain python or one torchrun, FSDP inside) with fault_tolerance.enable;
the groups meet at torchft's lighthouse (TORCHFT_LIGHTHOUSE). Every step:
1. quorum (torchft's Manager.start_quorum, waited for before the step): the groups alive now agree on who trains
   it. A group whose step is behind the quorum's (restarted, or late) first receives the live model, optimizer,
   lr schedule, data position and step from a peer through torchft's checkpoint transport (HTTP), reading
   nothing from disk, and trains the step with them.
2. forward and backward inside the group as without fault tolerance (FSDP reduce-scatters within the group);
3. each rank's gradients (its local shards: rank r of every group holds the same ones) and the loss are averaged
   with rank r of the other live groups through the Manager's process group, one collective per dtype: HSDP's
   replicate dimension, across jobs. Clipping then sees the same gradients in every group.
4. should_commit: the optimizer and the schedule step only when the group's collectives succeeded and the quorum
   had min_replica_size groups; otherwise nothing of the step is applied, it is logged, and the same step number
   is trained again on the next data.

Data: one global order (a token store, a mix or chat data: global_order.py) of group_size x the group's
data-parallel ranks; group g's ranks read its share of every step's windows. A missing group's share is
skipped, not reassigned: the position is a function of the attempts made, so nothing is read twice in an
epoch, and every live group, and a recovering one (which takes its peer's position), reads on in lockstep.
Exact resume under a changing quorum means: the same windows for the groups that were live, the missing
shares (and an uncommitted attempt's) left out and never read later in that epoch.

Checkpoints: in a shared checkpoint folder the first group of the quorum to reach a save claims it (a file
made with O_EXCL in the step folder) and writes it; the others skip it. Groups with folders of their own
each write theirs. A whole-job restart resumes from the checkpoint as without fault tolerance; a group
that loads an older step than its peers is brought up to theirs at the first quorum.

DiLoCo (semi_sync_method diloco, SemiSyncGroups below) replaces steps 1, 3 and 4 with a synchronization of the
weights every sync_steps steps.
"""

import os
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from titanlite.config_sections import FaultTolerance
from titanlite.errors import UserError
from titanlite.log import logger

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
CLAIM_FILE = ".replica_group"  # in a step folder: the replica group that writes that checkpoint


def local(tensor):
    """This rank's shard of a DTensor (rank r of every group holds the same one); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def lighthouse_address() -> str:
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise UserError("fault_tolerance.enable needs the lighthouse's address in TORCHFT_LIGHTHOUSE (e.g. "
                        "http://host:29510, where torchft_lighthouse runs); export it or set fault_tolerance.enable false")
    return address


def wait_for_lighthouse(address: str, timeout_s: int) -> None:
    """The lighthouse serves its status page at its address: a group that cannot reach it stops at the start,
    after job.init_timeout_seconds, instead of failing its first quorum."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a cluster's proxy never knows the lighthouse
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            opener.open(address, timeout=max(1.0, min(5.0, timeout_s))).close()
            return
        except (OSError, ValueError) as error:
            if time.monotonic() >= deadline:
                raise UserError(f"the lighthouse at TORCHFT_LIGHTHOUSE {address} did not answer within job.init_timeout_seconds "
                                f"{timeout_s} ({error}); start torchft_lighthouse there first (docs/launching.md) or fix the address") from None
            time.sleep(0.5)


def replica_process_group(cfg: FaultTolerance, device_type: str):
    """torchft's reconfigurable process group between the groups: nccl on CUDA, gloo on the CPU (auto)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    kind = cfg.process_group if cfg.process_group != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if kind == "nccl" and device_type != "cuda":
        raise UserError("fault_tolerance.process_group nccl needs CUDA but this run is on the CPU; set it to gloo or auto")
    timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
    return ProcessGroupNCCL(timeout=timeout) if kind == "nccl" else ProcessGroupGloo(timeout=timeout)


def group_store(world_size: int):
    """(address, port, store kept alive) of the store the group's ranks share, where torchft's Manager finds its
    server: torchrun's (MASTER_ADDR:MASTER_PORT), or for a world of one started by hand a store of its own."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")), None
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    return "127.0.0.1", store.port, store


def join_replica_groups(cfg: FaultTolerance, info, init_timeout_s: int) -> "ReplicaGroups":
    """This job's place among the replica groups: the torchft Manager, connected to the lighthouse (or a group
    alone when fault tolerance is off)."""
    if not cfg.enable:
        return ReplicaGroups(cfg, None)
    try:
        from torchft import Manager
        from torchft.checkpointing import HTTPTransport
    except ImportError:
        raise UserError("fault_tolerance.enable needs torchft, which is not installed; pip install 'titanlite[ft]' "
                        "(torchft==0.2.0) or set fault_tolerance.enable false") from None

    address = lighthouse_address()
    wait_for_lighthouse(address, init_timeout_s)
    store_addr, store_port, store = group_store(info.world_size)
    timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
    manager = Manager(
        pg=replica_process_group(cfg, info.device.type), load_state_dict=None, state_dict=None,
        min_replica_size=cfg.min_replica_size,
        use_async_quorum=False,  # the quorum (and any recovery) is done before the step: a recovered group trains it
        timeout=timeout,
        quorum_timeout=timedelta(seconds=init_timeout_s),  # a quorum waits for the lighthouse's stragglers
        connect_timeout=timeout, rank=info.rank, world_size=info.world_size, store_addr=store_addr, store_port=store_port,
        lighthouse_addr=address, replica_id=f"titanlite_{cfg.replica_id}",
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
        init_sync=False,  # every group initialises the same weights from job.seed
    )
    logger.info(f"fault tolerance: replica group {cfg.replica_id} of {cfg.group_size}, lighthouse {address}, "
                f"{type(manager._pg).__name__} between groups, a step commits with at least {cfg.min_replica_size} groups")
    return (SemiSyncGroups if cfg.semi_sync_method == "diloco" else ReplicaGroups)(cfg, manager, store)


class ReplicaGroups:
    """The step loop's view of the other replica groups; with manager None, a job alone (every call a no-op)."""

    def __init__(self, cfg: FaultTolerance, manager, store=None):
        self.cfg, self.manager, self.store = cfg, manager, store
        self.group_size, self.replica_id = (cfg.group_size, cfg.replica_id) if manager else (1, 0)
        self.quorum_id, self.live, self.quorum_changes, self.uncommitted = None, 0, 0, 0
        self.committed, self.recovered, self.jumped = True, False, 0
        self.state = self.model = self.optimizer = self.scheduler = self.dataloader = self.write_scalars = None
        self.batch_iter = None

    def outer_optimizer(self, model):
        """DiLoCo's outer optimizer, which the checkpoint keeps (SemiSyncGroups); none without DiLoCo."""
        return None

    def data_rank(self, dims) -> int:
        """This rank's reader index in the global order: group-major, then the group's data-parallel rank."""
        return self.replica_id * dims.dp_degree + dims.dp_rank

    def data_world(self, dims) -> int:
        return self.group_size * dims.dp_degree

    def track(self, state, *, model, optimizer, scheduler, dataloader, write_scalars) -> None:
        """What a recovering peer receives from this group, and what this group takes from one: registered with the
        Manager once the checkpoint (if any) is loaded, whose step the Manager starts from."""
        if self.manager is None:
            return
        if not getattr(dataloader, "state_is_global", False):
            raise UserError("fault_tolerance.enable needs a data position a peer can hand over: a token store (training.dataset_path "
                            "from python -m titanlite.data.prepare), a training.dataset_mix or chat data; other datasets keep a "
                            "position per rank")
        self.state, self.model, self.optimizer, self.scheduler = state, model, optimizer, scheduler
        self.dataloader, self.write_scalars = dataloader, write_scalars
        self.manager.register_state_dict_fn("titanlite", self.load_peer_state, self.peer_state)
        self.manager.load_state_dict({"step": state.step, "batches_committed": 0})

    def peer_state(self) -> dict:
        """This group's live state for a recovering peer (called on torchft's quorum thread while the loop waits
        for the quorum): each rank's local shards, which the same rank of the peer holds."""
        return {
            "model": {name: local(t) for name, t in self.model.state_dict().items()},
            "optimizer": tree_map(local, get_optimizer_state_dict(self.model, self.optimizer)),
            "lr_scheduler": self.scheduler.state_dict(),
            "dataloader": self.dataloader.state_dict(),
            "train_state": {"step": self.state.step, "tokens_seen": self.state.tokens_seen},
        }

    def load_peer_state(self, peer: dict) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in peer["model"].items():
                local(own[name]).copy_(tensor)
        set_optimizer_state_dict(self.model, self.optimizer, self.as_own_shards(peer["optimizer"]))
        self.scheduler.load_state_dict(peer["lr_scheduler"])
        self.dataloader.load_state_dict(peer["dataloader"])
        self.batch_iter = iter(self.dataloader)  # from the peer's position on
        self.jumped += peer["train_state"]["step"] - self.state.step
        self.state.step, self.state.tokens_seen = peer["train_state"]["step"], peer["train_state"]["tokens_seen"]
        self.recovered = True

    def take_jump(self) -> int:
        """The steps a recovery moved this group ahead by since the last call, which it never trained (the step
        line's per-step counts leave them out)."""
        jump, self.jumped = self.jumped, 0
        return jump

    def as_own_shards(self, optimizer_state: dict) -> dict:
        """A peer's optimizer state (local shards) as this rank's DTensors: a state tensor shaped like its
        parameter's shard is that shard (Adam's moments); the others (the step count) stay plain."""
        params = dict(self.model.named_parameters())
        for fqn, entries in optimizer_state["state"].items():
            param = params.get(fqn)
            if not isinstance(param, DTensor):
                continue
            shard = param.to_local()
            for key, value in entries.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == shard.shape:
                    entries[key] = DTensor.from_local(value.to(shard.device), param.device_mesh, param.placements,
                                                      run_check=False, shape=param.shape, stride=param.stride())
        return optimizer_state

    def batches(self, dataloader):
        """The loop's batch iterator; under fault tolerance one that a recovery restarts at the peer's position."""
        if self.manager is None:
            return iter(dataloader)
        self.batch_iter = iter(dataloader)
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.batch_iter)

    def steps(self, state, last: int):
        """The step numbers to train: range(state.step + 1, last + 1) alone; with other groups, a quorum before
        each (which may bring this group up to a peer's step) and the same number again after an uncommitted one."""
        if self.manager is None:
            yield from range(state.step + 1, last + 1)
            return
        while state.step < last:
            began = time.perf_counter()
            self.recovered = False
            self.manager.start_quorum()
            self.note_quorum(state.step + 1, time.perf_counter() - began)
            if state.step >= last:  # recovered at the peers' last step
                return
            before = state.step, state.tokens_seen
            yield state.step + 1
            if not self.committed:  # the loop counted it: the step is trained again
                state.step, state.tokens_seen = before

    def note_quorum(self, step: int, seconds: float) -> None:
        quorum_id = self.manager._quorum_id  # torchft has no public accessor for it
        live = self.manager.num_participants()
        if quorum_id != self.quorum_id:
            if self.quorum_id is not None:
                self.quorum_changes += 1
            logger.info(f"step: {step}  quorum {quorum_id}: {live} of {self.group_size} replica groups training "
                        f"(was {self.live if self.quorum_id is not None else 'none'}, {self.quorum_changes} quorum changes)")
            self.quorum_id, self.live = quorum_id, live
            self.write_scalars(step, {"fault_tolerance/live_replicas": live,
                                      "fault_tolerance/quorum_changes": self.quorum_changes}, flush=True)
        if self.recovered:
            logger.info(f"step: {step}  recovered from a live peer in {seconds:.2f}s: model, optimizer, lr schedule, data "
                        f"position and step {self.state.step} (nothing read from disk)")
            self.write_scalars(step, {"fault_tolerance/recovery_seconds": seconds}, flush=True)

    def average(self, model, loss: torch.Tensor, expert_loads: torch.Tensor | None = None) -> None:
        """Average every gradient (this rank's shards) and the loss with the other live groups in place, one
        collective per dtype; before clipping, so each group clips the same gradients. A model's tokens per expert
        (aux-loss-free balancing, step.py) are summed instead: every group then moves its routers' biases by the
        counts of the quorum's whole batch, as one process would."""
        if self.manager is None:
            return
        summed = None if expert_loads is None else self.manager.allreduce(expert_loads, reduce_op=dist.ReduceOp.SUM)
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in model.parameters():
            if param.grad is not None:
                grad = local(param.grad)
                buckets.setdefault(grad.dtype, []).append(grad)
        buckets.setdefault(loss.dtype, []).append(loss.reshape(1))  # a view: the loss is averaged with the gradients
        reductions = []
        for tensors in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            reductions.append((self.manager.allreduce(flat), flat, tensors))
        for work, flat, tensors in reductions:
            work.wait()
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        if summed is not None:
            summed.wait()

    def should_commit(self) -> bool:
        """Whether the step may be applied: the group's collectives succeeded and enough groups took part."""
        if self.manager is None:
            return True
        step = self.state.step + 1
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.uncommitted += 1
            error = self.manager.errored()
            why = (f"a collective between groups failed ({error.original_exception})" if error is not None else
                   f"{self.live} groups took part, fewer than fault_tolerance.min_replica_size {self.cfg.min_replica_size}")
            logger.warning(f"step: {step}  not committed: {why}; its update is not applied and the step is trained again "
                           f"on the next data ({self.uncommitted} uncommitted in this run)")
            self.write_scalars(step, {"fault_tolerance/uncommitted_steps": self.uncommitted}, flush=True)
        return self.committed

    def claims_save(self, path: Path) -> bool:
        """Whether this group writes the checkpoint at `path`: not after an uncommitted step (it is trained again);
        in a folder shared with other groups, only the group that claims the step first (or claimed it before)."""
        if self.manager is None:
            return True
        if not self.committed:
            return False
        claim = [True]
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            try:
                with open(path / CLAIM_FILE, "x") as file:  # O_EXCL: one group wins, on a shared filesystem too
                    file.write(f"{self.replica_id}\n")
            except FileExistsError:
                claim[0] = (path / CLAIM_FILE).read_text().strip() == str(self.replica_id)
        dist.broadcast_object_list(claim, src=0)
        if not claim[0]:
            logger.info(f"checkpoint {path.name}: another replica group of the quorum writes it; this group skips it")
        return claim[0]

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


class SemiSyncGroups(ReplicaGroups):
    """fault_tolerance.semi_sync_method diloco: each group steps its own (inner) optimizer every step, with no
    collective between groups; after every sync_steps of its optimizer steps, torchft's DiLoCo (hooked on that
    optimizer) holds the quorum, where a late or restarted group recovers from a peer, averages the pseudo-gradients
    (how far each group's weights moved since the last synchronization) and applies them with the outer Nesterov
    SGD. A synchronization that does not commit leaves every group at the weights of the last one that did: its
    sync_steps steps of updates are dropped, their data is not read again. The outer SGD's momentum is in the
    checkpoint, beside the optimizer."""

    def outer_optimizer(self, model):
        """The outer SGD over the trained parameters, made before the checkpoint's load, which may restore its
        momentum."""
        cfg = self.cfg
        trained = [param for param in model.parameters() if param.requires_grad]
        self.outer = torch.optim.SGD(trained, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)
        return self.outer

    def track(self, state, *, model, optimizer, scheduler, dataloader, write_scalars) -> None:
        if getattr(model, "take_step_loads", None) is not None:
            raise UserError("fault_tolerance.semi_sync_method diloco with a model that balances its experts by routing bias "
                            "(deepseek_v3) is not supported (the biases are no parameters, so DiLoCo would never average "
                            "them); set fault_tolerance.semi_sync_method none")
        super().track(state, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=dataloader,
                      write_scalars=write_scalars)
        from torchft.local_sgd import DiLoCo

        cfg = self.cfg
        # made after the checkpoint's load: DiLoCo keeps the weights it starts from as the first global ones
        self.diloco = DiLoCo(self.manager, [model], optimizer, self.outer, sync_every=cfg.sync_steps)
        self.diloco.__enter__()  # its hooks on the optimizer; ours after them, to see each synchronization's outcome
        self.inner_steps, self.began = 0, 0.0
        optimizer.register_step_pre_hook(self.before_inner_step)
        optimizer.register_step_post_hook(self.after_inner_step)
        self.manager.load_state_dict({"step": state.step // cfg.sync_steps, "batches_committed": 0})  # counts syncs

    def steps(self, state, last: int):
        """The step numbers to train, without a quorum before each; a recovery during a step's synchronization moves
        state.step to the peer's, from where the loop counts on."""
        while state.step < last:
            yield state.step + 1

    def before_inner_step(self, *_) -> None:
        self.began = time.perf_counter()

    def after_inner_step(self, *_) -> None:
        """After the optimizer's step (and DiLoCo's synchronization, when this step ended an interval): log the
        quorum, a recovery (its seconds: the step's and the synchronization's) and an uncommitted synchronization."""
        self.inner_steps += 1
        if self.inner_steps % self.cfg.sync_steps:
            return
        step = self.state.step + 1  # the loop's count of this step is not made yet (a recovery set the peer's)
        self.note_quorum(step, time.perf_counter() - self.began)
        self.recovered = False
        if self.manager._commit_failures:  # torchft resets it on a commit and counts a failure (no public accessor)
            self.uncommitted += 1
            logger.warning(f"step: {step}  synchronization not committed: every group is back at the weights of the last "
                           f"committed one ({self.uncommitted} uncommitted in this run)")
            self.write_scalars(step, {"fault_tolerance/uncommitted_steps": self.uncommitted}, flush=True)

    def average(self, model, loss: torch.Tensor, expert_loads: torch.Tensor | None = None) -> None:
        """Nothing between groups at a step: the synchronizations average the weights' moves instead."""

    def should_commit(self) -> bool:
        return True  # a group's own (inner) step always applies

