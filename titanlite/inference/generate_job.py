"""What python -m titanlite.generate does between its arguments and its exit: the prompts of [generate] (checked
before the model is built), their completions by api.LM in batches of generate.batch_size,
and one JSON line per prompt to generate.output or stdout: {"prompt", "prompt_token_ids", "completion",
"token_ids"}, token_ids holding only the new tokens."""

import json
import sys
from pathlib import Path

from titanlite.config_sections import Generate
from titanlite.errors import UserError
from titanlite.inference.api import LM
from titanlite.inference.decode import Sampling
from titanlite.inference.prompts import PromptRecord, checked_record, read_prompt_lines, render_prompts


def prompt_records(settings: Generate) -> list[PromptRecord]:
    """generate.prompt, else the records of generate.prompts_file."""
    if settings.prompt:
        return [checked_record({"prompt": settings.prompt}, "generate.prompt")]
    if settings.prompts_file:
        return read_prompt_lines(settings.prompts_file)
    raise UserError("there is nothing to generate from: set generate.prompt or generate.prompts_file")


def generate_records(lm: LM, records: list[PromptRecord], settings: Generate) -> list[dict]:
    """One {"prompt", "prompt_token_ids", "completion", "token_ids"} per record, in order, in batches of
    generate.batch_size (lm.speed adds their tokens and seconds)."""
    prompts = render_prompts(records, lm.tokenizer, lm.chat_template)
    sampling = Sampling(settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k, settings.seed,
                        tuple(settings.stop))
    return [{"prompt": c.prompt, "prompt_token_ids": c.prompt_token_ids, "completion": c.text, "token_ids": c.token_ids}
            for c in lm.complete(prompts, sampling, settings.batch_size)]


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
