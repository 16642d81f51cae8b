"""torchrun tests/exit_run.py <titanlite flags>: `python -m titanlite.train`, its exit included, with rank 0's gloo
worker thread waiting for the GIL when the interpreter begins its teardown, as a worker the scheduler starved did
at the end of finished runs under load (here on purpose, every time).

Training ends as usual. The ranks meet, then rank 0 starts an all-reduce on the world group (which DeviceMesh keeps
alive past destroy_process_group) and lets go of its tensor; rank 1 joins it a second later, while rank 0's last exit
handler holds the GIL in a C loop of several seconds; rank 0's worker completes the all-reduce and, to free the tensor,
waits for the GIL,
which the interpreter hands it only in its teardown."""

import atexit
import os

if os.environ["RANK"] == "0":
    # Registered before any library's handler, so it runs last, and in C: no bytecode runs after it that would
    # hand the GIL over before the teardown.
    atexit.register(sum, range(5 * 10**8))  # 4.6 s on a quiet 2-core machine, longer under load

import runpy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import titanlite.parallel.dist  # noqa: E402

real_close = titanlite.parallel.dist.close_distributed


def close_with_a_collective_in_flight() -> None:
    world = dist.group.WORLD
    # The ranks leave training up to seconds apart under load; meeting here keeps rank 1's join inside rank 0's
    # last exit handler (without it, CI once saw rank 0 gone before rank 1 joined: "Connection closed by peer").
    world.allreduce([torch.ones(1)]).wait()
    real_close()
    if world.rank() == 0:
        world.allreduce([torch.ones(4)])  # neither the work nor the tensor is kept
    else:
        time.sleep(1)  # rank 0 is in its last exit handler by then
        world.allreduce([torch.ones(4)]).wait()


titanlite.parallel.dist.close_distributed = close_with_a_collective_in_flight
sys.argv[0] = "titanlite.train"
runpy.run_module("titanlite.train", run_name="__main__", alter_sys=True)
