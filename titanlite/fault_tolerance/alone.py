"""A job alone (fault_tolerance.enable false): the step loop's view of the other replica groups when there are none.

Alone declares the interface the loop drives, each call a no-op; ReplicaGroups (replicas.py) and DiLoCoGroups
(diloco.py) fill it in. Who calls what, when:

    build_training: replicas = replica_groups(cfg.fault_tolerance)   # no network yet
                    the data loader reads as reader replicas.data_rank(dims) of replicas.data_world(dims)
    CheckpointManager(run, training): replicas.outer_optimizer(model) (DiLoCo's, saved), replicas.claims_save
    train.py, after checkpointer.load(): replicas.join(...)          # every rule checked, then the lighthouse
    the loop:
        with replicas.synchronizing():                                # DiLoCo's hooks on the optimizer, removed after
            while state.step < steps:
                watchdog.step_began(state.step + 1); summary.step_began(...)   # the quorum's wait is in the step
                if not replicas.start_step(state.step + 1): save state.step, stop   # the wait ended without a quorum
                take_recovery() not None: restart the batches at the peer's data position, add the jump to last_step
                train_step calls replicas.average (before clipping) and replicas.should_commit (before the update);
                    QuorumEnded out of it (DiLoCo's synchronization): save state.step, stop
                replicas.committed false: the attempt is not counted, logged or saved; train the same step again
                take_recovery() not None after it (DiLoCo): as above, and no loss line for this step
        replicas.raise_if_lost()        # LighthouseLost, after the save
    finally: replicas.close()
"""

import contextlib
from pathlib import Path


class Alone:
    group_size, replica_id = 1, 0
    committed = True  # the last attempt's update was applied

    def data_rank(self, dims) -> int:
        """This rank's reader index in the global order: group-major, then the group's data-parallel rank."""
        return self.replica_id * dims.dp_degree + dims.dp_rank

    def data_world(self, dims) -> int:
        return self.group_size * dims.dp_degree

    def outer_optimizer(self, model):
        """DiLoCo's outer optimizer, which the checkpoint keeps; none without DiLoCo."""
        return None

    def join(self, info, init_timeout_s: int, *, model, dataloader, objects: dict, write_scalars, stopping) -> None:
        """Meet the other groups, once the checkpoint (if any) is loaded (see ReplicaGroups.join)."""

    def synchronizing(self):
        """The context the step loop runs in (DiLoCo's hooks on the optimizer)."""
        return contextlib.nullcontext()

    def start_step(self, step: int) -> bool:
        """Before the attempt at `step`: whether to train it (False: save the last committed step and stop)."""
        return True

    def take_recovery(self) -> int | None:
        """The steps a recovery from a peer moved the train state by since the last call, None without one."""
        return None

    def average(self, model, loss, expert_loads=None) -> None:
        """Average the gradients and the loss with the other groups (before clipping)."""

    def should_commit(self) -> bool:
        return True

    def claims_save(self, path: Path) -> bool:
        """Whether this group writes the checkpoint at `path`."""
        return True

    def raise_if_lost(self) -> None:
        """After the loop: stop with the lighthouse's sentence where its loss ended the run."""

    def close(self) -> None:
        pass
