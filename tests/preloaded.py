"""`run_python(args, ...)`: what subprocess.run([sys.executable, *args], capture_output=True, text=True)
does, for `script.py ...` and `-m module ...`, without a new interpreter importing torch and titanlite
again (~5 CPU-seconds each time; the suite starts about 150 such processes): a launcher forked from a
multiprocessing forkserver (one per test process, started on first use, titanlite's trainer, model
families, torchrun and TensorBoard imported once) runs the script or module as __main__ with the
caller's argv, directory and environment, stdout and stderr going to files, and leaves as the
interpreter would: SystemExit's code, or 1 with the traceback for an exception, after the threads,
the atexit handlers and the flushes. Processes it starts itself (torchrun's ranks) are new
interpreters, or forked from it where the script forks them (tests/forked_torchrun.py)."""

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import forked_torchrun  # titanlite's trainer, the families, torchrun, TensorBoard: preloaded below

from titanlite.parallel.dist import exit_process

_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload([__name__])  # this module, and with it forked_torchrun's imports


def _as_main(args: list[str]) -> None:
    """`python args...` in this process: `-m module argv...` or `script argv...`, as __main__."""
    if args[0] == "-u":  # unbuffered: the output goes to files that are read after the exit
        args = args[1:]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        with warnings.catch_warnings():  # runpy's warning that the module was imported before: preloaded on purpose
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import", RuntimeWarning)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        forked_torchrun.run_script(*args)


def _launcher(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    os.setsid()  # its own process group: a timeout kills it with whatever it started
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    try:
        _as_main(args)
        code = 0
    except SystemExit as stop:  # as the interpreter reads it: None is 0, an int is the code, anything else printed, 1
        code = 0 if stop.code is None else stop.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_process(code)


def run_python(args: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, *args]
    with tempfile.NamedTemporaryFile() as out, tempfile.NamedTemporaryFile() as err:
        launcher = _SERVER.Process(target=_launcher, args=(args, cwd, env, out.name, err.name))
        launcher.start()
        launcher.join(timeout)
        timed_out = launcher.exitcode is None
        if timed_out:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.join()
        stdout, stderr = Path(out.name).read_text(), Path(err.name).read_text()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, launcher.exitcode, stdout, stderr)
