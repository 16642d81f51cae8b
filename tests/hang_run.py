"""torchrun tests/hang_run.py <titanlite flags>: titanlite's trainer with a fault injected from outside the
package for the hang watchdog's test: rank HANG_RANK blocks forever in its HANG_AT_STEP-th training step."""

import os
import sys
import time

import titanlite.train

real_train_step = titanlite.train.train_step
calls = 0


def train_step_that_hangs(*args, **kwargs):
    global calls
    calls += 1
    if os.environ["RANK"] == os.environ["HANG_RANK"] and calls == int(os.environ["HANG_AT_STEP"]):
        while True:  # a rank stuck in I/O or a deadlock: it never reaches the step's collectives
            time.sleep(1)
    return real_train_step(*args, **kwargs)


titanlite.train.train_step = train_step_that_hangs
sys.exit(titanlite.train.main(sys.argv[1:]))
