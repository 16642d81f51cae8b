"""Entry point: python -m titanlite.generate --job.config_file X.toml [--generate.prompt TEXT] [--section.key value ...]

The job's model (titanlite/inference/api.py's LM on model.py's model: its weights from a run's checkpoint or a Hugging Face folder, found
as training finds them) continues each prompt of [generate] (inference/generate_job.py); one JSON line per prompt
goes to generate.output or stdout: {"prompt", "prompt_token_ids", "completion", "token_ids"}, token_ids holding only
the new tokens. Under torchrun the ranks shard the weights (FSDP) and each generates every prompt; rank 0 writes them.
"""

import sys

from titanlite.config import load_config
from titanlite.errors import exit_code
from titanlite.inference.api import LM
from titanlite.inference.generate_job import generate_records, prompt_records, write_records
from titanlite.inference.model import build_inference_model
from titanlite.log import init_logger, logger
from titanlite.parallel.dist import close_distributed, init_distributed


def generate(argv: list[str]) -> None:
    cfg = load_config(argv)
    records = prompt_records(cfg.generate)  # a bad prompts file stops the command before the model is built
    try:
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        init_logger(info.rank)
        lm = LM.of(build_inference_model(cfg, info), compile=cfg.generate.compile)
        results = generate_records(lm, records, cfg.generate)
    finally:
        close_distributed()
    logger.info(f"generated {len(results)} completions: {lm.speed.line()}")
    if info.rank == 0:
        write_records(results, cfg.generate.output)


def main(argv: list[str]) -> int:
    return exit_code(generate, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
