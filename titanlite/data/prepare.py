"""Tokenize a corpus once into a token store (store.py) that training reads without tokenizing.

    python -m titanlite.data.prepare --input SRC --output DIR [--tokenizer PATH] [--workers N]
                                     [--format chat|prompt_completion [--train_on ...] [--chat_template FILE]]

SRC is a .jsonl/.json/.parquet/.arrow file or folder, a folder of .txt files (read as
training.dataset_path reads them), `sample` / `sample_val` (the shipped corpus), or a Hugging Face
dataset name, streamed (e.g. `--input allenai/c4 --hf_config en`). With --format, SRC holds chat or
prompt/completion records, rendered with the chat template of the Hugging Face tokenizer (or
--chat_template) and stored with their loss mask, for training.dataset_format of the same name.

Documents are cut into shards of --documents_per_shard in input order; worker processes tokenize
whole shards, each written under a temporary name and renamed when complete (the offsets file
last), so an interrupted prepare run again with the same arguments keeps the finished shards and
redoes the rest. The manifest is written last: a folder with a manifest is a complete store.
"""

import argparse
import functools
import itertools
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import xxhash

from titanlite.data.chat import ChatRenderer, Conversations, chat_record, tokenize_conversation
from titanlite.data.local_files import LOADER_BY_SUFFIX, load_local_documents
from titanlite.data.sample_corpus import SAMPLE_SPLITS, sample_split
from titanlite.data.store import (
    CHAT_STORE_VERSION,
    FORMAT,
    MANIFEST,
    concatenate,
    mask_path,
    shard_max_id,
    shard_paths,
    token_dtype,
    tokenizer_record,
)
from titanlite.data.store_checksums import CHUNK_BYTES, sums_path, write_chunk_sums
from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
from titanlite.errors import UserError
from titanlite.log import Progress, init_logger

PLAN = "prepare.json"  # the arguments a resume must repeat
ENCODE = None  # each tokenizing process builds its own (load_worker): document -> (ids, trained flags or None)


def open_input(source: str, text_field: str, hf_config: str, split: str):
    """The documents of SRC: a sequence (files, sample corpus) or an iterator (a streamed hub dataset)."""
    if source in SAMPLE_SPLITS:
        return sample_split(SAMPLE_SPLITS[source])
    if Path(source).exists() or Path(source).suffix in LOADER_BY_SUFFIX:
        return load_local_documents(source, text_field, "--input")
    import datasets

    try:
        stream = datasets.load_dataset(source, hf_config or None, split=split, streaming=True)
    except (OSError, ValueError) as error:  # offline, unknown name or config: the hub says which in its first line
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"--input {source} is no local file or folder and could not be streamed from the Hugging Face hub "
            f"({reason}); check the path, the dataset name and --hf_config, or the network"
        ) from None
    return (record[text_field] for record in stream)


def tokenize_shard(task: tuple) -> None:
    """Worker: tokenize one shard's documents as packing does (bos + text + eos; a conversation as chat.py
    does, with its mask) and write it, the offsets file last."""
    folder, shard, documents, dtype = task
    tokens, offsets, mask = concatenate([ENCODE(document) for document in documents], dtype)
    tokens_path, index_path = shard_paths(folder, shard)
    for path, data in ((tokens_path, tokens), (mask_path(folder, shard), mask)):
        if data is not None:
            write_then_rename(path, data.tofile)
            write_chunk_sums(path, data, write_then_rename)
    write_then_rename(index_path, lambda file: np.save(file, offsets))


def write_then_rename(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as file:
        write(file)
    temporary.replace(path)


def load_worker(path: str, chat: tuple | None) -> None:
    """Set ENCODE for text (chat None) or for conversations (chat = format, train_on, template file)."""
    global ENCODE
    tokenizer = load_tokenizer(path, origin="--tokenizer")
    if chat is None:
        ENCODE = lambda text: (tokenizer.encode(text, bos=True, eos=True), None)  # noqa: E731
    else:
        renderer = ChatRenderer(tokenizer, chat[2])
        ENCODE = functools.partial(tokenize_conversation, renderer, tokenizer, train_on=chat[1])


def check_plan(folder: Path, plan: dict) -> None:
    """A folder holding part of another prepare is refused, not mixed with this one."""
    path = folder / PLAN
    if path.is_file() and json.loads(path.read_text()) != plan:
        raise UserError(
            f"--output {folder} holds a store prepared with other arguments ({path}); use another "
            "--output folder, or delete it to prepare it again"
        )
    if not path.is_file() and folder.exists() and any(folder.iterdir()):
        raise UserError(f"--output {folder} is a folder with other files in it; give an empty or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1))


def shard_tasks(documents, folder: Path, per_shard: int, dtype, progress: Progress):
    """(folder, shard, texts, dtype) for every shard not finished yet; finished ones are skipped unread
    where the input has random access (and counted as an earlier run's in `progress`)."""
    indexed = hasattr(documents, "__getitem__")
    stream = iter(documents) if not indexed else None
    for shard in itertools.count():
        done = shard_paths(folder, shard)[1].is_file()
        if indexed:
            chosen = range(shard * per_shard, min((shard + 1) * per_shard, len(documents)))
            if not chosen:
                return
            texts, count = ([] if done else [documents[i] for i in chosen]), len(chosen)
        else:
            texts = list(itertools.islice(stream, per_shard))
            if not texts:
                return
            count = len(texts)
        if done:
            progress.skip(count)
        else:
            yield folder, shard, texts, dtype


def record_missing_sums(folder: Path, shard: int, tokens: np.ndarray) -> None:
    """The chunk checksums of a shard that a prepare of an earlier titanlite finished without them (resumed now)."""
    for path, data in ((shard_paths(folder, shard)[0], tokens), (mask_path(folder, shard), None)):
        if path.is_file() and not sums_path(path).is_file():
            data = np.fromfile(path, dtype=np.uint8) if data is None else data
            write_chunk_sums(path, data, write_then_rename)


def write_manifest(folder: Path, plan: dict, tokenizer, dtype, chat: dict | None) -> dict:
    shards = []
    for shard in itertools.count():
        index_path = shard_paths(folder, shard)[1]
        if not index_path.is_file():
            break
        offsets = np.load(index_path)
        tokens = np.memmap(shard_paths(folder, shard)[0], dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype)
        record_missing_sums(folder, shard, tokens)
        shards.append(
            {
                "documents": len(offsets) - 1,
                "tokens": int(offsets[-1]),
                "max_id": shard_max_id(tokens),
                "index_xxh3": xxhash.xxh3_64(index_path.read_bytes()).hexdigest(),
            }
        )
    if not shards:
        raise UserError(f"--input {plan['input']} holds no documents; point it at data that has some")
    manifest = {
        "format": FORMAT,
        "input": plan["input"],
        "tokenizer": tokenizer_record(tokenizer),
        "dtype": dtype.name,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
        "checksums": {"algorithm": "xxh3_64", "chunk_bytes": CHUNK_BYTES},
    }
    if chat is not None:
        manifest["chat"] = {**chat, "version": CHAT_STORE_VERSION}
    write_then_rename(folder / MANIFEST, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    return manifest


def prepare(
    source: str,
    output: str,
    tokenizer_path: str = "",
    *,
    workers: int = 1,
    text_field: str = "text",
    documents_per_shard: int = 20000,
    hf_config: str = "",
    split: str = "train",
    dataset_format: str = "text",
    train_on: str = "assistant",
    chat_template: str = "",
    progress_seconds: float = 30.0,
) -> dict:
    """Write (or finish) the store for SRC in output; returns its manifest."""
    tokenizer_path = tokenizer_path or str(SHIPPED_TOKENIZER)
    tokenizer = load_tokenizer(tokenizer_path, origin="--tokenizer")
    folder = Path(output)
    plan = {
        "input": source,
        "tokenizer_sha256": tokenizer_record(tokenizer)["sha256"],
        "text_field": text_field,
        "documents_per_shard": documents_per_shard,
        "hf_config": hf_config,
        "split": split,
    }
    # a bad input leaves no folder behind
    if dataset_format == "text":
        chat, worker_chat = None, None
        documents = open_input(source, text_field, hf_config, split)
    else:
        chat, worker_chat = (
            chat_record(ChatRenderer(tokenizer, chat_template), dataset_format, train_on),
            (dataset_format, train_on, chat_template),
        )
        documents = Conversations(source, dataset_format, "--input")
        plan["chat"] = chat
    check_plan(folder, plan)
    dtype = token_dtype(tokenizer.vocab_size)
    total = len(documents) if hasattr(documents, "__len__") else None
    # A line after a shard (or a wave of them) once progress_seconds have passed: documents done, time left.
    progress = Progress(total, f"tokenizing {source}", progress_seconds, unit="document")
    tasks = shard_tasks(documents, folder, documents_per_shard, dtype, progress)
    if workers == 1:
        load_worker(tokenizer_path, worker_chat)
        for task in tasks:
            tokenize_shard(task)
            progress.advance(len(task[2]))
    else:
        with multiprocessing.Pool(workers, load_worker, (tokenizer_path, worker_chat)) as pool:
            # In waves: Pool.imap would read a streamed input ahead without bound.
            while wave := list(itertools.islice(tasks, 2 * workers)):
                pool.map(tokenize_shard, wave)
                progress.advance(sum(len(task[2]) for task in wave))
    progress.done()
    return write_manifest(folder, plan, tokenizer, dtype, chat)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", required=True, help="data file or folder, sample / sample_val, or a Hugging Face dataset name"
    )
    parser.add_argument("--output", required=True, help="the store's folder (new or empty, or a prepare to finish)")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer.model, or a Hugging Face tokenizer.json or folder holding one, to tokenize with "
        "(default: the shipped one)",
    )
    parser.add_argument(
        "--workers", type=int, default=max(multiprocessing.cpu_count() - 1, 1), help="tokenizing processes"
    )
    parser.add_argument("--text_field", default="text", help="field holding the text in json/parquet/arrow records")
    parser.add_argument("--documents_per_shard", type=int, default=20000, help="documents per shard file")
    parser.add_argument(
        "--hf_config", default="", help="configuration of a Hugging Face dataset (e.g. en for allenai/c4)"
    )
    parser.add_argument("--split", default="train", help="split of a Hugging Face dataset")
    parser.add_argument(
        "--format",
        default="text",
        choices=("text", "chat", "prompt_completion"),
        help="chat / prompt_completion: local records rendered with the chat template, stored with their loss mask",
    )
    parser.add_argument(
        "--train_on",
        default="assistant",
        choices=("assistant", "last_assistant", "all"),
        help="with --format, the tokens in the loss (as training.train_on)",
    )
    parser.add_argument(
        "--chat_template", default="", help="with --format, a jinja template file instead of the tokenizer folder's"
    )
    return parser


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    init_logger(0)  # the progress lines
    try:
        if args.workers < 1 or args.documents_per_shard < 1:
            raise UserError(
                f"--workers ({args.workers}) and --documents_per_shard ({args.documents_per_shard}) must be at least 1"
            )
        if args.format == "text" and (args.train_on != "assistant" or args.chat_template):
            raise UserError(
                "--train_on and --chat_template apply to --format chat or prompt_completion; add --format or drop them"
            )
        if args.format != "text" and not args.tokenizer and not args.chat_template:
            raise UserError(
                f"--format {args.format} renders each record with a chat template, which the shipped tokenizer "
                "lacks; add --tokenizer <a Hugging Face tokenizer folder with its chat template> (or --chat_template)"
            )
        blocker = next(
            (p for p in (Path(args.output), *Path(args.output).parents) if p.exists() and not p.is_dir()), None
        )
        if blocker is not None:
            raise UserError(
                f"--output {args.output} cannot be a folder because {blocker} is a file; choose another path"
            )
        manifest = prepare(
            args.input,
            args.output,
            args.tokenizer,
            workers=args.workers,
            text_field=args.text_field,
            documents_per_shard=args.documents_per_shard,
            hf_config=args.hf_config,
            split=args.split,
            dataset_format=args.format,
            train_on=args.train_on,
            chat_template=args.chat_template,
        )
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.output}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['dtype']}) in {len(manifest['shards'])} shards"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
