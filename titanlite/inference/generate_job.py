"""What python -m titanlite.generate does between its arguments and its exit: the prompts of [generate] (checked
before the model is built), their completions on an InferenceModel (model.py) in batches of generate.batch_size,
and one JSON line per prompt to generate.output or stdout: {"prompt", "prompt_token_ids", "completion",
"token_ids"}, token_ids holding only the new tokens."""

import json
import sys
from pathlib import Path

from titanlite.config_sections import Generate
from titanlite.errors import UserError
from titanlite.inference.decode import Sampling, Speed, generate_ids
from titanlite.inference.model import InferenceModel
from titanlite.inference.prompts import PromptRecord, checked_record, completion_text, read_prompt_lines, render_prompts


def prompt_records(settings: Generate) -> list[PromptRecord]:
    """generate.prompt, else the records of generate.prompts_file."""
    if settings.prompt:
        return [checked_record({"prompt": settings.prompt}, "generate.prompt")]
    if settings.prompts_file:
        return read_prompt_lines(settings.prompts_file)
    raise UserError("there is nothing to generate from: set generate.prompt or generate.prompts_file")


def generate_records(loaded: InferenceModel, records: list[PromptRecord], settings: Generate,
                     speed: Speed | None = None) -> list[dict]:
    """One {"prompt", "prompt_token_ids", "completion", "token_ids"} per record, in order; `speed` adds the tokens
    and seconds of the prefills and decode steps."""
    tokenizer = loaded.tokenizer
    prompts = render_prompts(records, tokenizer, loaded.cfg.training.chat_template)
    sampling = Sampling(settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k, settings.seed,
                        tuple(settings.stop))
    results = []
    for start in range(0, len(prompts), settings.batch_size):
        batch = prompts[start:start + settings.batch_size]
        new = generate_ids(loaded.model, loaded.args, tokenizer, [prompt.ids for prompt in batch], sampling,
                           indices=list(range(start, start + len(batch))), speed=speed)
        results += [{"prompt": prompt.text, "prompt_token_ids": prompt.ids,
                     "completion": completion_text(ids, tokenizer, settings.stop), "token_ids": ids}
                    for prompt, ids in zip(batch, new)]
    return results


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
