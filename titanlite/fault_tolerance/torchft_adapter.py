"""Everything titanlite does with torchft 0.2.0's Manager and DiLoCo, and the only module that reads or writes their
private fields: each such use says why no public API serves. torchft is imported here only, when a group joins."""

import threading
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import Callable

from titanlite.errors import UserError

QUORUM_ATTEMPT_SECONDS = 5  # one request of the quorum to the lighthouse; torchft retries within the quorum's timeout
WAIT_SLICE_SECONDS = 0.25  # how often a quorum wait looks at the stop flags


def import_torchft():
    try:
        import torchft
    except ImportError:
        raise UserError(
            "fault_tolerance.enable needs torchft, which is not installed; pip install 'titanlite[ft]' "
            "(torchft==0.2.0) or set fault_tolerance.enable false"
        ) from None
    return torchft


def replica_process_group(kind: str, device_type: str, timeout: timedelta):
    """torchft's reconfigurable process group between the groups: nccl on CUDA, gloo on the CPU (auto)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    kind = kind if kind != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if kind == "nccl" and device_type != "cuda":
        raise UserError(
            "fault_tolerance.process_group nccl needs CUDA but this run is on the CPU; set it to gloo or auto"
        )
    return ProcessGroupNCCL(timeout=timeout) if kind == "nccl" else ProcessGroupGloo(timeout=timeout)


class QuorumEnded(Exception):
    """A quorum wait inside DiLoCo's synchronization ended without a quorum (see QuorumWait)."""


class QuorumWait(Future):
    """The future of one quorum, which torchft's start_quorum waits on with result(): waited for in slices, so that a
    stop signal (handled between them) ends the wait within a fraction of a second. Ended by a stop signal or by
    the quorum's failure (the lighthouse did not answer in time), the Manager is marked errored (nothing commits),
    `on_end` is told why, and the wait returns as a quorum with an error would; or with `raising` (DiLoCo's
    synchronization, whose should_commit would wait on the Manager's server until the quorum's request timed out)
    raises QuorumEnded out of the optimizer's step."""

    def __init__(
        self, manager, stopping: Callable[[], bool], on_end: Callable[[BaseException | None], None], raising: bool
    ):
        super().__init__()
        self.manager, self.stopping, self.on_end, self.raising, self.ended = manager, stopping, on_end, raising, False

    def result(self, timeout=None):
        while not self.ended and not self.done():
            if self.stopping():
                self.end(None)
                return None
            wait([self], timeout=WAIT_SLICE_SECONDS)  # a signal's handler runs between the slices
        if not self.ended and self.exception() is not None:
            self.end(self.exception())
        return None

    def end(self, error: BaseException | None) -> None:
        self.ended = True
        self.manager.report_error(error or RuntimeError("the quorum wait was ended by a stop signal"))
        self.on_end(error)
        if self.raising:
            raise QuorumEnded() from error


class DaemonQuorumExecutor:
    """Runs each of the Manager's quorums on a daemon thread of its own. torchft's executor thread is joined when the
    process exits, and a quorum request to a lighthouse that is gone cannot be cancelled: a group stopped during
    such a wait would then hang until the request timed out. A quorum's future is a QuorumWait."""

    def __init__(
        self, manager, stopping: Callable[[], bool], on_end: Callable[[BaseException | None], None], raising: bool
    ):
        self.manager, self.stopping, self.on_end, self.raising = manager, stopping, on_end, raising

    def submit(self, fn, *args, **kwargs) -> QuorumWait:
        future = QuorumWait(self.manager, self.stopping, self.on_end, self.raising)

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # handed to the thread that waits for the quorum
                future.set_exception(error)

        threading.Thread(target=run, name="torchft_quorum", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to join: a quorum still in flight ends with the process."""


def new_manager(
    cfg,
    info,
    address: str,
    store_addr: str,
    store_port: int,
    stopping: Callable[[], bool],
    on_end: Callable[[BaseException | None], None],
    raising: bool,
):
    """torchft's Manager for this group: its quorums bounded by fault_tolerance.quorum_timeout_seconds, their request
    sent again to the lighthouse every few seconds within that bound (torchft's quorum_retries), which reaches a
    lighthouse restarted at the same address."""
    from torchft import Manager
    from torchft.checkpointing import HTTPTransport

    timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
    manager = Manager(
        pg=replica_process_group(cfg.process_group, info.device.type, timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=cfg.min_replica_size,
        use_async_quorum=False,  # the quorum (and any recovery) is done before the step: a recovered group trains it
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
        connect_timeout=timeout,
        rank=info.rank,
        world_size=info.world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=address,
        replica_id=f"titanlite_{cfg.replica_id}",
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
        init_sync=False,  # every group initialises the same weights from job.seed
        quorum_retries=quorum_retries(cfg.quorum_timeout_seconds),
    )
    # Private: the Manager runs its quorums on this executor and offers no way to choose it (DaemonQuorumExecutor).
    manager._executor.shutdown(wait=False)
    manager._executor = DaemonQuorumExecutor(manager, stopping, on_end, raising)
    return manager


def quorum_retries(quorum_timeout_seconds: int) -> int:
    """torchft splits a quorum's timeout evenly over its first request and the retries."""
    return max(0, quorum_timeout_seconds // QUORUM_ATTEMPT_SECONDS - 1)


def quorum_id(manager) -> int:
    return manager._quorum_id  # private: torchft has no public accessor for the current quorum's id


def commit_failures(manager) -> int:
    """Uncommitted steps in a row: torchft resets it on a commit (private: no public accessor)."""
    return manager._commit_failures


def process_group_name(manager) -> str:
    return type(manager._pg).__name__  # private: the Manager does not expose the process group it was given


def new_diloco(manager, model, optimizer, outer_optimizer, sync_steps: int):
    """torchft's DiLoCo over the whole model, hooked on the inner optimizer when entered as a context."""
    from torchft.local_sgd import DiLoCo

    return DiLoCo(manager, [model], optimizer, outer_optimizer, sync_every=sync_steps)
