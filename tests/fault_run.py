"""torchrun tests/fault_run.py <titanlite flags>: titanlite's trainer with a fault injected from outside the
package: rank FAULT_RANK, in its FAULT_AT_STEP-th training step, blocks forever (FAULT=hang, for the hang
watchdog's test) or meets a user error the other ranks do not (FAULT=user_error)."""

import os
import sys
import time

import titanlite.train
from titanlite.errors import UserError

real_train_step = titanlite.train.train_step
calls = 0


def train_step_with_a_fault(*args, **kwargs):
    global calls
    calls += 1
    if os.environ["RANK"] == os.environ["FAULT_RANK"] and calls == int(os.environ["FAULT_AT_STEP"]):
        if os.environ["FAULT"] == "user_error":  # e.g. a file missing on one node only
            raise UserError(f"rank {os.environ['RANK']} alone cannot go on")
        while True:  # a rank stuck in I/O or a deadlock: it never reaches the step's collectives
            time.sleep(1)
    return real_train_step(*args, **kwargs)


titanlite.train.train_step = train_step_with_a_fault
sys.exit(titanlite.train.main(sys.argv[1:]))
