"""Issue 61.4: a run that has said it is exiting leaves within seconds, whatever still runs in it.

A replica group stopped by SIGTERM after its lighthouse died saved its step and said "stopped at step N on SIGTERM;
exiting", then stayed on past the scheduler's 30 s grace while torchft's quorum retried a lighthouse that was gone.
parallel/dist.py's exit_process now leaves with the run's exit code EXIT_SECONDS after it began, whatever it waits
for (a thread joined at exit, an exit handler, a blocked write), saying so with every thread's stack; where the GIL is
held all along, faulthandler's C watchdog ends it at twice that, exit 1. The real replica groups with a killed
lighthouse: tests/test_fault_tolerance.py (extended tier).
"""

import subprocess
import sys
import time

import pytest
from conftest import ROOT, with_root_on_path

from titanlite.parallel.dist import EXIT_SECONDS

STUCK = """
import threading, time
from titanlite.parallel.dist import exit_process

def wait_for_a_peer_that_is_gone():
    time.sleep(3600)

threading.Thread(target=wait_for_a_peer_that_is_gone).start()  # not a daemon: Python's exit joins it
print("exiting", flush=True)
exit_process(3)
"""


def test_a_process_whose_exit_waits_forever_leaves_with_its_code_within_seconds():
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK],
        cwd=ROOT,
        env=with_root_on_path(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "exiting\n"
    said = time.monotonic()
    out, err = process.communicate(timeout=EXIT_SECONDS + 30)
    assert process.returncode == 3, err[-3000:]
    assert EXIT_SECONDS <= time.monotonic() - said < EXIT_SECONDS + 5
    assert err.startswith(
        "warning: the process was still exiting 10 s after its run ended; it leaves now with exit "
        "code 3 (where each thread was:)\n"
    ), err[-3000:]
    assert "in wait_for_a_peer_that_is_gone" in err  # the stack of what kept it


HOLDING_THE_GIL = """
import atexit
from titanlite.parallel.dist import exit_process

atexit.register(sum, range(10**13))  # C that never lets go of the GIL (as a C++ destructor waiting on a peer could)
print("exiting", flush=True)
exit_process(3)
"""


@pytest.mark.extended
def test_a_process_whose_exit_holds_the_gil_leaves_too():
    """No Python thread runs while the GIL is held: faulthandler's watchdog (a C thread) ends the process at twice
    EXIT_SECONDS, exit 1."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDING_THE_GIL],
        cwd=ROOT,
        env=with_root_on_path(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "exiting\n"
    said = time.monotonic()
    out, err = process.communicate(timeout=EXIT_SECONDS + 30)
    assert process.returncode == 1, err[-3000:]
    assert 2 * EXIT_SECONDS <= time.monotonic() - said < 2 * EXIT_SECONDS + 6
    assert err.startswith("Timeout (0:00:20)!\n") and "in exit_process" in err, err[-3000:]
