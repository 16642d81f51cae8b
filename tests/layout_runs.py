"""Run by the layout tests (under torchrun, or alone for world 1): several trainer runs in one
launch, so the process start-up is paid once. argv[1] is a JSON list of runs, executed in order:

    {"argv": [trainer flags...], "resume_from": "<step folder>" or null}

The runs of a launch share its rl.generator_ranks (the first run's): on a generator rank each run is served.
A run with resume_from starts from a copy of that checkpoint step folder (any layout's): rank 0
copies it into the run's own checkpoint folder first. Each run writes TensorBoard into its own
job.dump_folder, which the test reads the losses from (float32, unlike the 4-decimal console).
"""

import faulthandler
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from titanlite.config import load_config
from titanlite.parallel.dist import close_distributed, init_distributed
from titanlite.rl.generator_rank import serve
from titanlite.train import train


def main(runs_json: str) -> None:
    runs = json.loads(Path(runs_json).read_text())
    info = None
    for run in runs:
        cfg = load_config(run["argv"])
        info = info or init_distributed(cfg.job.device, cfg.job.init_timeout_seconds, cfg.rl.generator_ranks)
        if run.get("resume_from") and info.rank == 0 and not info.generating:
            source = Path(run["resume_from"])
            shutil.copytree(source, Path(cfg.job.dump_folder) / cfg.checkpoint.folder / source.name)
        dist.barrier()
        (serve if info.generating else train)(cfg, info)
    close_distributed()


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # as titanlite.train.main does: a rank that aborts shows where
    main(sys.argv[1])
