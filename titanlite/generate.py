"""Entry point: python -m titanlite.generate --job.config_file X.toml [--generate.prompt TEXT] [--section.key value ...]

The job's Run (inference.py: its weights from a run's checkpoint or a Hugging Face folder, found as training
finds them) continues each prompt of [generate] (generation.py); one JSON line per prompt goes to generate.output
or stdout: {"prompt", "completion", "token_ids"}, token_ids holding only the new tokens. Under torchrun the ranks
shard the weights (FSDP) and each generates every prompt; rank 0 writes them.
"""

import json
import sys
from pathlib import Path

from titanlite.config import load_config
from titanlite.config_sections import Generate
from titanlite.data.chat import ChatRenderer
from titanlite.errors import UserError, exit_code
from titanlite.generation import Sampling, generate_ids
from titanlite.inference import build_inference_run
from titanlite.log import init_logger
from titanlite.parallel.dist import close_distributed, init_distributed


def read_prompt_lines(path: str, key: str = "generate.prompts_file") -> list[dict]:
    """The records of the prompts file `path` (the config key `key`), each {"prompt"}, {"messages"} or {"token_ids"}."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {key} {path} ({error}); point it at a JSON-lines file") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{key} {path} line {number} is not JSON ({error.msg}); fix that line") from None
        if not isinstance(record, dict) or len({"prompt", "messages", "token_ids"} & set(record)) != 1:
            raise UserError(f"{key} {path} line {number} must hold exactly one of \"prompt\", \"messages\" "
                            "or \"token_ids\"; fix that line")
        records.append(record)
    return records


def prompt_ids(record: dict, tokenizer, renderer) -> tuple[str, list[int]]:
    """(the prompt as text, its token ids): text after the tokenizer's bos as training documents start,
    messages rendered with the chat template's generation prompt, token ids as given."""
    if "token_ids" in record:
        ids = record["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise UserError("a prompt's \"token_ids\" must be a list of integers; fix the prompts file")
        return tokenizer.decode(ids), ids
    if "messages" in record:
        text = renderer().render(record["messages"], add_generation_prompt=True)
    else:
        text = str(record["prompt"])
    ids = tokenizer.encode(text, bos=False, eos=False)
    return text, ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id] + ids


def completion_text(new_ids: list[int], tokenizer, stop: list[str]) -> str:
    """The new tokens as text, cut before the first stop string."""
    text = tokenizer.decode(new_ids)
    cuts = [text.index(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


def prompt_records(settings: Generate) -> list[dict]:
    """generate.prompt, else the records of generate.prompts_file."""
    records = [{"prompt": settings.prompt}] if settings.prompt else []
    if not records and settings.prompts_file:
        records = read_prompt_lines(settings.prompts_file)
    if not records:
        raise UserError("there is nothing to generate from: set generate.prompt or generate.prompts_file")
    return records


def generate_records(run, records: list[dict], settings: Generate) -> list[dict]:
    """One {"prompt", "completion", "token_ids"} per prompt record of build.py's `run`, in order."""
    tokenizer = run.tokenizer

    def renderer() -> ChatRenderer:
        return ChatRenderer(tokenizer, run.cfg.training.chat_template)

    prompts = [prompt_ids(record, tokenizer, renderer) for record in records]
    sampling = Sampling(settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k, settings.seed,
                        tuple(settings.stop))
    results = []
    for start in range(0, len(prompts), settings.batch_size):
        batch = prompts[start:start + settings.batch_size]
        new = generate_ids(run.model, run.args, tokenizer, [ids for _, ids in batch], sampling)
        results += [{"prompt": text, "completion": completion_text(ids, tokenizer, settings.stop), "token_ids": ids}
                    for (text, _), ids in zip(batch, new)]
    return results


def write_records(records: list[dict], output: str) -> None:
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
    records = prompt_records(cfg.generate)
    try:
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        init_logger(info.rank)
        results = generate_records(build_inference_run(cfg, info), records, cfg.generate)
    finally:
        close_distributed()
    if info.rank == 0:
        write_records(results, cfg.generate.output)


def main(argv: list[str]) -> int:
    return exit_code(generate, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
