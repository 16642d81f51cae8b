"""Fault tolerance on torchft: replica groups that train on when one of them is lost.

Each replica group is one titanlite job (plain python or one torchrun, FSDP inside) with fault_tolerance.enable;
the groups meet at torchft's lighthouse (TORCHFT_LIGHTHOUSE).

    alone.py           a job alone (fault tolerance off): the interface the loop drives, every call a no-op
    replicas.py        groups that average every step's gradients (a quorum before each step)
    diloco.py          DiLoCo: groups that train alone and synchronize their weights every sync_steps steps
    peer_state.py      a recovering group takes a peer's state through the checkpoint's own objects
    join.py            the lighthouse's address and the group's store
    torchft_adapter.py the Manager and DiLoCo, and every read of torchft's private fields

Data: one global order (a token store, a mix or chat data: global_order.py) of group_size x the group's
data-parallel ranks; group g's ranks read its share of every step's windows. A missing group's share is
skipped, not reassigned: the position is a function of the attempts made, so nothing is read twice in an
epoch, and every live group, and a recovering one (which takes its peer's position), reads on in lockstep.

Checkpoints: in a shared checkpoint folder the first group of the quorum to reach a save claims it (a file
made with O_EXCL in the step folder) and writes it; the others skip it. Groups with folders of their own
each write theirs. A whole-job restart resumes from the checkpoint as without fault tolerance; a group
that loads an older step than its peers is brought up to theirs at the first quorum.
"""

from titanlite.config_sections import FaultTolerance
from titanlite.fault_tolerance.alone import Alone
from titanlite.fault_tolerance.diloco import DiLoCoGroups
from titanlite.fault_tolerance.replicas import CLAIM_FILE, LighthouseLost, ReplicaGroups
from titanlite.fault_tolerance.torchft_adapter import QuorumEnded

__all__ = ["Alone", "CLAIM_FILE", "DiLoCoGroups", "LighthouseLost", "QuorumEnded", "ReplicaGroups", "replica_groups"]


def replica_groups(cfg: FaultTolerance) -> Alone:
    """This job's view of the replica groups, before it meets them (ReplicaGroups.join): alone without fault
    tolerance, else groups averaging every step or synchronizing DiLoCo-style."""
    if not cfg.enable:
        return Alone()
    return DiLoCoGroups(cfg) if cfg.semi_sync_method == "diloco" else ReplicaGroups(cfg)
