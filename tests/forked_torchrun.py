"""`python tests/forked_torchrun.py N script args...` (or `N -m titanlite.train flags...`): the script
(or the trainer's command) under torchrun --standalone --nproc_per_node N, with torchrun's own launcher
(torch.distributed.run's arguments and config, its elastic agent, rendezvous and per-rank environment),
but each rank forked from this process after it has imported titanlite's trainer instead of started
afresh. The layout tests start about 120 ranks and conftest.run_titanlite's runs about 40; each would
otherwise spend its first ~5 CPU-seconds importing torch and titanlite again. Tests whose subject is the
launch itself (exit codes and torchrun's report, signals, restarts, GPUs) start fresh ranks from torchrun's
own command line instead (conftest.run_titanlite's fresh_ranks). The tests start this file itself from
tests/preloaded.py, which has imported it already."""

import faulthandler
import os
import runpy
import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.launcher.api import elastic_launch

import titanlite.train  # imported once here, inherited by every forked rank
from titanlite.models import list_model_specs

# What every rank would import again on its own: the model families (moe.py's compiler.disable brings
# torch._dynamo) and TensorBoard's writer (the runs write their losses there).
list_model_specs()
import torch.utils.tensorboard  # noqa: F401,E402


def run_script(path: str, *argv: str) -> None:
    """The script as `python script argv...` would run it (in one rank, or in a launcher of tests/preloaded.py)."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def train_rank(*flags: str) -> None:
    """`python -m titanlite.train flags...` in a forked rank: its main and exit code, without its exit_process,
    whose os._exit would leave torchrun waiting for the rank's return value (a rank of torchrun's fork start
    returns, or raises SystemExit with its code; multiprocessing then ends it without the interpreter's teardown)."""
    faulthandler.enable(all_threads=True)
    code = titanlite.train.main(list(flags))
    if code:
        sys.exit(code)


def main(nproc: str, script: str, *argv: str) -> None:
    # The forked ranks are CPU (gloo) ranks. On a machine with a GPU, a rank forked after this launcher has
    # started CUDA cannot start it again ("CUDA error: initialization error"), and torch 2.11's optimizers ask
    # CUDA whether it is capturing a graph whenever a GPU is visible: hidden before anything counts them.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    trainer = script == "-m"  # torchrun's own flag: argv[0] is then the module
    if trainer and argv[0] != "titanlite.train":
        raise ValueError(f"forked ranks run scripts or -m titanlite.train, not -m {argv[0]}")
    args = torchrun.parse_args(["--standalone", f"--nproc_per_node={nproc}", "--start-method", "fork", script, *argv])
    # What --standalone sets in torchrun's run(): a one-node rendezvous on a free local port.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(args)
    if trainer:
        elastic_launch(config, entrypoint=train_rank)(*argv[1:])
    else:
        elastic_launch(config, entrypoint=run_script)(script, *argv)


if __name__ == "__main__":
    main(*sys.argv[1:])
