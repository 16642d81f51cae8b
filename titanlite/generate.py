"""Entry point: python -m titanlite.generate --job.config_file X.toml [--generate.prompt TEXT] [--section.key value ...]

The job's model (inference/model.py: its weights from a run's checkpoint or a Hugging Face folder, found as training
finds them) continues each prompt of [generate] (generate.prompt, or the records of generate.prompts_file, checked
before the model is built) through the Python API's LM, in batches of generate.batch_size; one JSON line per
prompt goes to generate.output or stdout: {"prompt", "prompt_token_ids", "completion", "token_ids"}, token_ids
holding only the new tokens. Under torchrun the ranks shard the weights (FSDP) and each generates every prompt;
rank 0 writes them.
"""

import json
import sys
from pathlib import Path

from titanlite.config import load_config
from titanlite.config_sections import Generate
from titanlite.errors import UserError, exit_code
from titanlite.inference.api import LM
from titanlite.inference.model import build_inference_model
from titanlite.inference.prompts import PromptRecord, checked_record, read_prompt_lines, render_prompts
from titanlite.inference.sampling import Sampling
from titanlite.log import init_logger, logger
from titanlite.parallel.dist import close_distributed, init_distributed


def prompt_records(settings: Generate) -> list[PromptRecord]:
    """generate.prompt, or the records of generate.prompts_file (one of the two)."""
    if settings.prompt and settings.prompts_file:
        raise UserError(
            f"generate.prompt and generate.prompts_file {settings.prompts_file} are both set; set one of them"
        )
    if settings.prompt:
        return [checked_record({"prompt": settings.prompt}, "generate.prompt")]
    if settings.prompts_file:
        return read_prompt_lines(settings.prompts_file)
    raise UserError("there is nothing to generate from: set generate.prompt or generate.prompts_file")


def generate_records(lm: LM, records: list[PromptRecord], settings: Generate) -> list[dict]:
    """One {"prompt", "prompt_token_ids", "completion", "token_ids"} per record, in order, in batches of
    generate.batch_size (lm.speed adds their tokens and seconds)."""
    prompts = render_prompts(records, lm.tokenizer, lm.chat_template)
    sampling = Sampling(
        settings.max_new_tokens,
        settings.temperature,
        settings.top_p,
        settings.top_k,
        settings.seed,
        tuple(settings.stop),
        min_new_tokens=settings.min_new_tokens,
        ignore_eos=settings.ignore_eos,
    )
    return [
        {"prompt": c.prompt, "prompt_token_ids": c.prompt_token_ids, "completion": c.text, "token_ids": c.token_ids}
        for c in lm.complete(prompts, sampling, settings.batch_size)
    ]


def write_records(records: list[dict], output: str) -> None:
    """JSON lines to the file `output` (generate.output), or to stdout where it is empty."""
    lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    if not output:
        sys.stdout.write(lines)
        return
    try:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(lines)
    except OSError as error:
        raise UserError(f"cannot write generate.output {output} ({error.strerror}); pick a writable path") from None


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
