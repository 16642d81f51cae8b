"""Replica groups that average every step's gradients through torchft (fault_tolerance.semi_sync_method none).

Every step:
1. quorum (torchft's Manager.start_quorum, before the step): the groups alive now agree on who trains it. A group
   whose step is behind the quorum's (restarted, or late) first receives a peer's live state through the checkpoint's
   own objects (peer_state.py: model, optimizer, lr schedule, data position, step, RNG), reading nothing from disk,
   and trains the step with it. A fresh job's first step waits (up to job.init_timeout_seconds) until every group is
   in the quorum, so that no group trains step 1 alone on its share of the batch.
2. forward and backward inside the group as without fault tolerance (FSDP reduce-scatters within the group);
3. each rank's gradients (its local shards: rank r of every group holds the same ones) and the loss are averaged in
   place with rank r of the other live groups through the Manager's process group, one collective per tensor:
   HSDP's replicate dimension, across jobs. Clipping then sees the same gradients in every group.
4. should_commit: the optimizer and the schedule step only when the group's collectives succeeded and the quorum
   had min_replica_size groups; otherwise nothing of the step is applied, the attempt is logged as not committed,
   and the same step number is trained again on the next data.

A quorum waits at most fault_tolerance.quorum_timeout_seconds (the first: job.init_timeout_seconds), its request sent
again every few seconds, which reaches a lighthouse restarted at the same address. When no quorum comes, or a stop
signal arrives during the wait, the loop saves the last committed step and stops; without a signal the run then
ends with one sentence naming the lighthouse (LighthouseLost).
"""

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config_sections import FaultTolerance
from titanlite.errors import UserError
from titanlite.fault_tolerance.alone import Alone
from titanlite.fault_tolerance.join import group_store, lighthouse_address, wait_for_lighthouse
from titanlite.fault_tolerance.peer_state import load_peer_state, peer_state
from titanlite.fault_tolerance.torchft_adapter import import_torchft, new_manager, process_group_name, quorum_id
from titanlite.log import logger
from titanlite.models.init import local_tensor

CLAIM_FILE = ".replica_group"  # in a step folder: the replica group that writes that checkpoint
START_POLL_SECONDS = 0.5  # between the quorums of a fresh job's first step, while groups are missing


class LighthouseLost(UserError):
    """No quorum came from the lighthouse in time: one sentence, after the group saved its last committed step."""


class ReplicaGroups(Alone):
    quorum_inside_step = False  # the quorum is held before the step (start_step)

    def __init__(self, cfg: FaultTolerance):
        self.cfg, self.group_size, self.replica_id = cfg, cfg.group_size, cfg.replica_id
        self.manager = self.store = self.address = None
        self.quorum_id, self.live, self.quorum_changes, self.uncommitted = None, 0, 0, 0
        self.step, self.jump, self.loss, self.ended, self.lost = 0, None, None, False, None
        self.quorum_began = 0.0

    def check(self, model, dataloader) -> None:
        """Rules that need the built model or data loader, checked before the lighthouse is contacted."""
        if not getattr(dataloader, "state_is_global", False):
            raise UserError(
                "fault_tolerance.enable needs a data position a peer can hand over: a token store "
                "(training.dataset_path "
                "from python -m titanlite.data.prepare), a training.dataset_mix or chat data; other datasets keep a "
                "position per rank"
            )

    def join(self, info, init_timeout_s: int, *, model, dataloader, objects: dict, write_scalars, stopping) -> None:
        """Every rule checked, then this job's place among the replica groups: torchft's Manager, connected to the
        lighthouse, with the checkpoint's objects as what a recovering peer receives from this group and what this
        group takes from one; the Manager starts from the loaded step."""
        self.check(model, dataloader)
        import_torchft()
        self.address = lighthouse_address()
        wait_for_lighthouse(self.address, init_timeout_s)
        self.objects, self.write_scalars, self.init_timeout_s = objects, write_scalars, init_timeout_s
        store_addr, store_port, self.store = group_store(info.world_size)
        self.manager = new_manager(
            self.cfg,
            info,
            self.address,
            store_addr,
            store_port,
            stopping,
            self.quorum_ended,
            raising=self.quorum_inside_step,
        )
        self.manager.register_state_dict_fn("titanlite", self.load_peer_state, lambda: peer_state(self.objects))
        self.manager.load_state_dict({"step": self.manager_step(), "batches_committed": 0})
        logger.info(
            f"fault tolerance: replica group {self.replica_id} of {self.group_size}, lighthouse {self.address}, "
            f"{process_group_name(self.manager)} between groups, a step commits with at least "
            f"{self.cfg.min_replica_size} groups, a quorum waits at most {self.cfg.quorum_timeout_seconds}s"
        )

    @property
    def train_state(self):
        return self.objects["train_state"].state

    def manager_step(self) -> int:
        """The Manager's step: the steps trained (a recovering group's is below its peers')."""
        return self.train_state.step

    def quorum_ended(self, error: BaseException | None) -> None:
        """A quorum wait ended without a quorum: by a stop signal (error None) or by the quorum's failure."""
        self.ended, self.lost = True, error

    def load_peer_state(self, state: dict) -> None:
        before = self.train_state.step
        load_peer_state(self.objects, state)
        self.jump = (self.jump or 0) + self.train_state.step - before

    def take_recovery(self) -> int | None:
        jump, self.jump = self.jump, None
        return jump

    def start_step(self, step: int) -> bool:
        """The quorum before `step` (it may bring this group up to a peer's step); False when it ended without one."""
        self.step, self.quorum_began = step, time.perf_counter()
        first = self.quorum_id is None
        timeout = timedelta(seconds=self.init_timeout_s if first else self.cfg.quorum_timeout_seconds)
        deadline, waiting = time.monotonic() + self.init_timeout_s, False
        while True:
            self.manager.start_quorum(timeout=timeout)
            if self.ended:
                return False
            live = self.manager.num_participants()
            if not (first and self.train_state.step == 0 and live < self.group_size and time.monotonic() < deadline):
                break
            if not waiting:  # a fresh job: a group alone would train step 1 on its share of the batch only
                logger.info(
                    f"step: {step}  waiting for all {self.group_size} replica groups before the first step "
                    f"({live} in the quorum so far; at most job.init_timeout_seconds {self.init_timeout_s})"
                )
                waiting = True
            time.sleep(START_POLL_SECONDS)
        self.step = self.train_state.step + 1  # a recovery moved the train state to the peer's
        self.note_quorum(self.step)
        return True

    def note_quorum(self, step: int) -> None:
        live = self.manager.num_participants()
        current = quorum_id(self.manager)
        if current != self.quorum_id:
            if self.quorum_id is not None:
                self.quorum_changes += 1
            logger.info(
                f"step: {step}  quorum {current}: {live} of {self.group_size} replica groups training "
                f"(was {self.live if self.quorum_id is not None else 'none'}, {self.quorum_changes} quorum changes)"
            )
            self.quorum_id, self.live = current, live
            self.write_scalars(
                step,
                {"fault_tolerance/live_replicas": live, "fault_tolerance/quorum_changes": self.quorum_changes},
                flush=True,
            )
        if self.jump is not None:
            seconds = time.perf_counter() - self.quorum_began
            logger.info(
                f"step: {step}  recovered from a live peer in {seconds:.2f}s: model, optimizer, lr schedule, data "
                f"position, RNG and step {self.train_state.step} (nothing read from disk)"
            )
            self.write_scalars(step, {"fault_tolerance/recovery_seconds": seconds}, flush=True)

    def average(self, model, loss: torch.Tensor, expert_loads: torch.Tensor | None = None) -> None:
        """Average every gradient (this rank's shards) and the loss with the other live groups in place, one
        collective per tensor; before clipping, so each group clips the same gradients. A model's tokens per expert
        (aux-loss-free balancing, step.py) are summed instead: every group then moves its routers' biases by the
        counts of the quorum's whole batch, as one process would."""
        self.loss = loss
        works = [] if expert_loads is None else [self.manager.allreduce(expert_loads, reduce_op=dist.ReduceOp.SUM)]
        works += [
            self.manager.allreduce(local_tensor(param.grad)) for param in model.parameters() if param.grad is not None
        ]
        works.append(self.manager.allreduce(loss.view(1)))  # a view: the loss is averaged in place too
        for work in works:
            work.wait()

    def should_commit(self) -> bool:
        """Whether the step may be applied: the group's collectives succeeded and enough groups took part."""
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.uncommitted += 1
            error = self.manager.errored()
            why = (
                f"a collective between groups failed ({error.original_exception})"
                if error is not None
                else f"{self.live} groups took part, fewer than fault_tolerance.min_replica_size "
                f"{self.cfg.min_replica_size}"
            )
            logger.warning(
                f"step: {self.step} (not committed)  loss: {self.loss.item():.4f}  {why}; its update is not applied "
                f"and step {self.step} is trained again on the next data ({self.uncommitted} uncommitted in this run)"
            )
            self.write_scalars(self.step, {"fault_tolerance/uncommitted_steps": self.uncommitted}, flush=True)
        return self.committed

    def claims_save(self, path: Path) -> bool:
        """Whether this group writes the checkpoint at `path`: in a folder shared with other groups, only the group
        that claims the step first (or claimed it before)."""
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

    def raise_if_lost(self) -> None:
        if self.ended and self.lost is not None:
            raise LighthouseLost(
                f"no quorum came from the lighthouse at TORCHFT_LIGHTHOUSE {self.address} for step {self.step} within "
                f"fault_tolerance.quorum_timeout_seconds {self.cfg.quorum_timeout_seconds} "
                f"({type(self.lost).__name__}); this group stopped "
                f"at step {self.train_state.step}, its last committed (saved where checkpoint.enable is on): restart "
                "torchft_lighthouse at that address, or bring back the groups its --min_replicas needs, then start "
                "this "
                "group again with the same command"
            )

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
