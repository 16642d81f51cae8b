"""Where a replica group meets the others: the lighthouse's address, and the store its ranks share."""

import os
import time
import urllib.request

import torch.distributed as dist

from titanlite.errors import UserError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def lighthouse_address() -> str:
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise UserError(
            "fault_tolerance.enable needs the lighthouse's address in TORCHFT_LIGHTHOUSE (e.g. "
            "http://host:29510, where torchft_lighthouse runs); export it or set fault_tolerance.enable false"
        )
    return address


def wait_for_lighthouse(address: str, timeout_s: int) -> None:
    """The lighthouse serves its status page at its address: a group that cannot reach it stops at the start,
    after job.init_timeout_seconds, instead of failing its first quorum."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({})
    )  # a cluster's proxy never knows the lighthouse
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            opener.open(address, timeout=max(1.0, min(5.0, timeout_s))).close()
            return
        except (OSError, ValueError) as error:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"the lighthouse at TORCHFT_LIGHTHOUSE {address} did not answer within job.init_timeout_seconds "
                    f"{timeout_s} ({error}); start torchft_lighthouse there first (docs/launching.md) or fix the "
                    "address"
                ) from None
            time.sleep(0.5)


def group_store(world_size: int):
    """(address, port, store kept alive) of the store the group's ranks share, where torchft's Manager finds its
    server: torchrun's (MASTER_ADDR:MASTER_PORT), or for a world of one started by hand a store of its own."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")), None
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    return "127.0.0.1", store.port, store
