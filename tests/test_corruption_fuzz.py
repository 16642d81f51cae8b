"""Every file titanlite reads, damaged on purpose with a fixed seed, read back by the function training (or convert)
opens it with: a token store (text and chat), chat records (jsonl, parquet), a chat template, a Hugging Face folder
written by transformers (config.json, model.safetensors, tokenizer.json), a DCP checkpoint of an in-process run with
its checksums and lineage (rewound.json, the dump-folder lock), and the run's config.toml.

The damage: truncate, flip bytes, change a JSON/TOML field's type, delete a file, add a stray file. Each case must end
in a UserError naming the damaged file (or its folder), or succeed with exactly what the undamaged files give. Files
a user brings (records, templates, Hugging Face folders, TOML) carry no checksum: a flip or cut that leaves a valid
file of its kind (as the file's own library reads it) may also read differently, since titanlite cannot know what it
held before; a changed field type never may. Never a traceback.
"""

import hashlib
import json
import os
import random
import re
import shutil
import tomllib
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from conftest import DEBUG_CONFIG, ON_CPU
from titanlite.errors import UserError

SEED = int(os.environ.get("FUZZ_SEED", 20261128))  # fixed; another only to explore by hand
OUTCOMES = ("refused naming the file", "refused a valid user file's value", "read the same",
            "read a valid user file's other data")
STRAY_BYTES = 64


@dataclass
class Target:
    """One input as a reader sees it: a folder (copied per case), the files to damage in it (relative), the reader
    (folder -> what it read), and which files are the user's (no checksum: see the module's docstring)."""

    name: str
    folder: Path
    files: list[str]
    read: Callable[[Path], object]
    user_files: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ("truncate", "flip", "retype", "delete")


# ---------------------------------------------------------------- damage
def rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # a new file: case folders share the big files with the fixture as hard links
    path.write_bytes(data)


def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    keep = rng.randrange(len(data)) if data else 0
    rewrite(path, data[:keep])
    return f"truncated to {keep} of {len(data)} bytes"


def flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:  # a few scattered bytes
        spots = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))]
    else:  # a run, as the 400 bytes XORed into a .distcp
        start = rng.randrange(len(data))
        spots = list(range(start, min(len(data), start + rng.randint(1, 400))))
    high = rng.random() < 0.5  # any byte, or one that keeps ASCII text ASCII (a digit or a letter changed: valid JSON)
    for spot in spots:
        data[spot] ^= rng.randrange(1, 256 if high else 128)
    rewrite(path, bytes(data))
    return f"flipped {len(spots)} byte(s) from {spots[0]}"


def other_type(value, rng: random.Random):
    """A JSON value of another kind than value's (never null: config.json reads null as "not set")."""
    kinds = {"number": 7, "text": "seven", "bool": True, "list": [1], "object": {"x": 1}}
    kind = ("bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else
            "text" if isinstance(value, str) else "list" if isinstance(value, list) else "object")
    return kinds[rng.choice(sorted(set(kinds) - {kind}))]


def leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    if path:
        yield path


def retyped_json(document, rng: random.Random) -> tuple[object, str]:
    path = rng.choice(list(leaves(document)))
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = other_type(parent[path[-1]], rng)
    return document, f"{'.'.join(map(str, path))} -> {json.dumps(parent[path[-1]])}"


def retype(path: Path, rng: random.Random) -> str:
    text = path.read_text()
    if path.suffix == ".toml":  # one `key = value` line's value, as a TOML literal of another type
        lines = text.splitlines()
        number = rng.choice([i for i, line in enumerate(lines) if re.match(r"^\w+ = ", line)])
        key, value = lines[number].split(" = ", 1)
        lines[number] = f"{key} = {other_toml(tomllib.loads(lines[number])[key], rng)}"
        rewrite(path, ("\n".join(lines) + "\n").encode())
        return f"{key} = {value} -> {lines[number]}"
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines()]
        number = rng.randrange(len(records))
        records[number], what = retyped_json(records[number], rng)
        rewrite(path, "".join(json.dumps(r) + "\n" for r in records).encode())
        return f"record {number + 1}: {what}"
    document, what = retyped_json(json.loads(text), rng)
    rewrite(path, json.dumps(document, indent=1).encode())
    return what


def other_toml(value, rng: random.Random) -> str:
    literal = json.dumps(other_type(value, rng))
    return {"true": "true", "{\"x\": 1}": "{ x = 1 }"}.get(literal, literal)


def delete(path: Path, rng: random.Random) -> str:
    path.unlink()
    return "deleted"


DAMAGE = {"truncate": truncate, "flip": flip, "retype": retype, "delete": delete}
STRUCTURED = (".json", ".jsonl", ".toml")


def stray(folder: Path, rng: random.Random, names: list[str]) -> Path:
    """A file nobody wrote, named like the folder's own files or not."""
    path = folder / rng.choice(names)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.randbytes(STRAY_BYTES))
    return path


# ---------------------------------------------------------------- what is valid without titanlite
def valid_as_its_kind(path: Path) -> bool:
    """Whether a user's damaged file still reads with its own library (then it may hold other data)."""
    if not path.is_file():
        return False
    try:
        if path.suffix in (".json", ".jsonl"):
            text = path.read_bytes().decode("utf-8")
            if path.name == "tokenizer.json":
                import tokenizers

                tokenizers.Tokenizer.from_str(text)
            for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
                json.loads(line)
        elif path.suffix == ".toml":
            tomllib.loads(path.read_bytes().decode("utf-8"))
        elif path.suffix == ".parquet":
            import pyarrow.parquet

            pyarrow.parquet.read_table(path)
        elif path.suffix == ".jinja":
            import jinja2

            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(path.read_bytes().decode("utf-8"))
        elif path.suffix == ".safetensors":
            from safetensors.torch import load_file

            load_file(path)
        return True
    except Exception:  # whatever the library raises: the file is not valid as its kind
        return False


# ---------------------------------------------------------------- one case
def copy_folder(source: Path, destination: Path) -> None:
    """Big files as hard links (damage rewrites a file, never edits it in place), small ones copied."""
    def link_or_copy(src, dst):
        if os.path.getsize(src) > 1 << 20:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source, destination, copy_function=link_or_copy)


def outcome(read: Callable[[Path], object], folder: Path) -> tuple[str, object]:
    try:
        return "read", read(folder)
    except UserError as error:
        return "refused", str(error)
    except Exception:  # the defect this test exists to find
        return "traceback", traceback.format_exc(limit=-6)


def judge(target: Target, relative: str, kind: str, what: str, folder: Path, clean) -> tuple[str, str | None]:
    """(how the case ended, None when that is right or else what went wrong)."""
    result, value = outcome(target.read, folder)
    where = f"{target.name}: {relative} {what}"
    if result == "traceback":
        return result, f"{where}: a traceback\n{value}"
    if result == "refused":
        if "\n" in value:
            return result, f"{where}: not one sentence: {value}"
        if relative.split("/")[-1] in value or str(folder / Path(relative).parent) in value:
            return "refused naming the file", None
        if relative in target.user_files and valid_as_its_kind(folder / relative):
            return "refused a valid user file's value", None  # its sentence names the key or record
        return result, f"{where}: the sentence does not name the file: {value}"
    if value == clean:
        return "read the same", None
    if relative in target.user_files and kind in ("truncate", "flip") and valid_as_its_kind(folder / relative):
        return "read a valid user file's other data", None  # nothing to compare it with
    return "read differently", f"{where}: read silently, and differently from the undamaged files"


def run_cases(target: Target, tmp: Path, rng: random.Random, per_file: int, stray_names: list[str]) -> Counter:
    """per_file cases drawn for each file (kinds that apply to it), plus one stray file; returns how they ended, and
    the failures (under their sentences)."""
    clean = target.read(target.folder)
    ended = Counter()
    plans = []
    for relative in target.files:
        kinds = [k for k in target.kinds if k != "retype" or relative.endswith(STRUCTURED)]
        drawn = rng.sample(kinds, min(per_file, len(kinds))) + rng.choices(kinds, k=max(per_file - len(kinds), 0))
        plans += [(relative, kind) for kind in drawn]
    plans.append(("", "stray"))
    for relative, kind in plans:
        folder = tmp / f"{target.name}-{sum(ended.values())}"
        copy_folder(target.folder, folder)
        if kind == "stray":
            relative = str(stray(folder, rng, stray_names).relative_to(folder))
            what = "added"
        else:
            what = DAMAGE[kind](folder / relative, rng)
        how, problem = judge(target, relative, kind, what, folder, clean)
        ended[problem or how] += 1
        shutil.rmtree(folder, ignore_errors=True)
    return ended


# ---------------------------------------------------------------- digests of what was read
def tensors_digest(values) -> str:
    digest = hashlib.sha256()
    for value in values:
        if torch.is_tensor(value):
            digest.update(value.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def loader_digest(loader) -> str:
    """Every batch of one finite pass."""
    return tensors_digest(tensor for inputs, labels in loader for tensor in (inputs, labels))


# ---------------------------------------------------------------- the inputs and their readers
SEQ = 16
STRAY_STORE = ["shard-00099.bin", "shard-00009.idx.npy", "notes.txt", "prepare.json"]


def loader_reader(tokenizer, **spec) -> Callable[[Path], str]:
    """A finite pass of the loader training builds, for the data at folder / spec's dataset_path (or the folder)."""
    from titanlite.data.datasets import DataSpec, build_dataloader

    def read(folder: Path) -> str:
        fields = {key: str(folder / value) if key in ("dataset_path", "chat_template") and value and not Path(value).is_absolute()
                  else value for key, value in spec.items()}
        fields.setdefault("dataset_path", str(folder))
        fields.setdefault("seq_len", SEQ)
        return loader_digest(build_dataloader(DataSpec("sample", batch_size=8, infinite=False, **fields),
                                              tokenizer, 0, 1, 0))
    return read


def read_hf_folder(folder: Path) -> tuple:
    """What a run started from the folder reads: its config (the model), its tokenizer and its weights."""
    from titanlite.checkpoint.hf_io import load_model_from_hf
    from titanlite.config import load_config
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models.hf_folder import read_model_folder

    cfg = load_config([*ON_CPU, "--model.hf_assets_path", str(folder)])
    tokenizer = build_tokenizer(cfg.model)
    model_folder = read_model_folder(folder, cfg.model.name)
    with torch.device("meta"):
        model = model_folder.spec.model_cls(model_folder.args)
    state = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in model.state_dict().items()}
    load_model_from_hf(state, folder, model_folder.spec.hf_adapter, model_folder.args, cfg.model.name)
    return (cfg.model.name, cfg.model.flavor, repr(model_folder.args), tokenizer.vocab_size, tokenizer.bos_id,
            tokenizer.eos_id, tokenizer.encode("What does Python's help say?", bos=True, eos=True), tensors_digest(state.values()))


def read_config_toml(folder: Path) -> str:
    from titanlite.config import load_config, to_toml

    return to_toml(load_config(["--job.config_file", str(folder / "config.toml")])).replace(str(folder), "<folder>")


def read_converted(folder: Path) -> str:
    """python -m titanlite.convert dcp-to-hf of the folder's newest checkpoint: the weights it writes."""
    from titanlite.convert import run

    destination = folder.with_name(folder.name + "-hf")
    run(["dcp-to-hf", str(folder / "checkpoint" / "step-2"), str(destination)])
    written = (destination / "model.safetensors").read_bytes()
    shutil.rmtree(destination)
    return hashlib.sha256(written).hexdigest()


def read_lock(folder: Path) -> str:
    """A second run's look at the lock of a live one (this process): refused while it runs."""
    from titanlite.checkpoint.lock import take_lock

    try:
        take_lock(folder)
    except UserError as error:
        if "is in use by another run" in str(error):
            return "in use"
        raise
    return "taken over"


class CheckpointReader:
    """The trainer's resume on a real Run, optimizer, schedule and loader: CheckpointManager.load, then what it
    restored (step, tokens seen, model and optimizer tensors, data position)."""

    def __init__(self, flags: list[str]):
        from titanlite.build import build_run, training_data
        from titanlite.config import load_config
        from titanlite.data.datasets import build_dataloader
        from titanlite.optim import build_lr_scheduler, build_optimizer
        from titanlite.parallel.dist import init_distributed

        self.cfg = cfg = load_config(flags)
        self.run = build_run(cfg, init_distributed("cpu", 60))
        self.optimizer = build_optimizer(self.run.model, cfg.optimizer, "cpu")
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(training_data(cfg.training), self.run.tokenizer, 0, 1, cfg.job.seed)

    def reader(self, load_step: int) -> Callable[[Path], tuple]:
        def read(folder: Path) -> tuple:
            from titanlite.checkpoint import CheckpointManager

            self.cfg.job.dump_folder, self.cfg.checkpoint.load_step = str(folder), load_step
            for tensor in self.run.model.parameters():  # what a load leaves unset must show in the digest
                tensor.data.fill_(float("nan"))
            manager = CheckpointManager(self.run, self.optimizer, self.scheduler, self.dataloader)
            try:
                state = manager.load()
            finally:
                manager.close()
            optimizer = self.optimizer.state_dict()["state"]
            return (state.step, state.tokens_seen, tensors_digest(self.run.model.state_dict().values()),
                    tensors_digest(t for by_name in optimizer.values() for t in by_name.values()),
                    repr(self.dataloader.state_dict()))
        return read


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    import gc

    import pyarrow
    import pyarrow.parquet

    from titanlite.checkpoint.folders import REWOUND
    from titanlite.checkpoint.lock import take_lock
    from titanlite.data.chat_example import CHATML_TEMPLATE, chat_records, write_tokenizer_folder
    from titanlite.data.prepare import prepare
    from titanlite.data.sample_corpus import sample_split
    from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
    from titanlite.parallel.dist import close_distributed
    from titanlite.train import main

    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("fuzz")
    tokenizer_folder = write_tokenizer_folder(root / "tokenizer")
    hf_tokenizer, shipped = load_tokenizer(tokenizer_folder), load_tokenizer(SHIPPED_TOKENIZER)
    records = chat_records(12)
    for name, write in (("jsonl", lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in records))),
                        ("parquet", lambda p: pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), p))):
        (root / name).mkdir()
        write(root / name / f"chats.{name}")
    (root / "template").mkdir()
    (root / "template" / "chat.jinja").write_text(CHATML_TEMPLATE)
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_split("train")[:12]))
    prepare(str(root / "texts.jsonl"), str(root / "store"), documents_per_shard=6)
    prepare(str(root / "jsonl" / "chats.jsonl"), str(root / "chat_store"), str(tokenizer_folder), dataset_format="chat",
            documents_per_shard=6)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=hf_tokenizer.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, root / "hf" / name)
    flags = [*ON_CPU, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(root / "dump"), "--model.n_layers", "1",
             "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "2",
             "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--metrics.log_freq", "1"]
    assert main(flags) == 0
    gc.enable()
    (root / "dump" / "checkpoint" / REWOUND).write_text(json.dumps({"step": 1, "at": "2026-11-28 09:00:00"}))
    (root / "toml").mkdir()
    shutil.copy(root / "dump" / "config.toml", root / "toml" / "config.toml")
    (root / "lock").mkdir()
    take_lock(root / "lock")
    checkpoint = CheckpointReader(flags)
    chat = dict(dataset_format="chat", seq_len=256)  # a window holds a conversation
    step = "checkpoint/step-2"
    yield [
        (Target("store", root / "store", ["manifest.json", "shard-00000.bin", "shard-00000.bin.xxh3", "shard-00000.idx.npy",
                                          "shard-00001.bin"], loader_reader(shipped)), 4, STRAY_STORE),
        (Target("chat_store", root / "chat_store", ["manifest.json", "shard-00000.bin", "shard-00000.mask.bin",
                                                    "shard-00000.mask.bin.xxh3", "shard-00001.idx.npy"],
                loader_reader(hf_tokenizer, **chat)), 4, STRAY_STORE),
        (Target("jsonl", root / "jsonl", ["chats.jsonl"], loader_reader(hf_tokenizer, dataset_path="chats.jsonl", **chat),
                ("chats.jsonl",)), 4, ["notes.txt"]),
        (Target("parquet", root / "parquet", ["chats.parquet"],
                loader_reader(hf_tokenizer, dataset_path="chats.parquet", **chat), ("chats.parquet",)), 3, ["notes.txt"]),
        (Target("template", root / "template", ["chat.jinja"],
                loader_reader(hf_tokenizer, dataset_path=str(root / "jsonl" / "chats.jsonl"), chat_template="chat.jinja", **chat),
                ("chat.jinja",)), 3, ["notes.txt"]),
        (Target("hf", root / "hf", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"],
                read_hf_folder, ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")), 4,
         ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "notes.txt", "pytorch_model.bin"]),
        (Target("checkpoint", root / "dump", [f"{step}/__0_0.distcp", f"{step}/.metadata", f"{step}/checksums/rank0.json"],
                checkpoint.reader(-1)), 3,
         [f"{step}/__1_0.distcp", f"{step}/notes.txt", f"{step}/checksums/rank1.json", "checkpoint/step-3/.metadata"]),
        (Target("convert", root / "dump", [f"{step}/__0_0.distcp", f"{step}/.metadata", f"{step}/checksums/rank0.json"],
                read_converted), 2, [f"{step}/notes.txt"]),
        # Deleting rewound.json is how a user rewinds again (folders.py), not damage.
        (Target("lineage", root / "dump", ["checkpoint/rewound.json"], checkpoint.reader(1),
                kinds=("truncate", "flip", "retype")), 3, ["checkpoint/notes.txt"]),
        # The lock of a live run: a pid flipped into another is a run gone as far as anyone can tell, and a deleted
        # lock no lock; a damaged record must still hold the folder (it ages into staleness).
        (Target("lock", root / "lock", [".titanlite.lock"], read_lock, kinds=("truncate", "retype")), 4,
         ["notes.txt", ".titanlite.partial"]),
        (Target("config_toml", root / "toml", ["config.toml"], read_config_toml, ("config.toml",)), 3, ["notes.txt"]),
    ]
    close_distributed()


def test_every_reader_refuses_damage_in_one_sentence_or_reads_the_same(targets, tmp_path, capsys):
    rng = random.Random(SEED)
    ended = Counter()
    with capsys.disabled():
        print(f"\ncorruption fuzz, seed {SEED}:")
        for target, per_file, stray_names in targets:
            by_target = run_cases(target, tmp_path, rng, per_file, stray_names)
            print(f"  {target.name}: " + ", ".join(f"{count} {how}" for how, count in by_target.items() if how in OUTCOMES))
            ended += by_target
        print(f"  {sum(ended.values())} cases")
    failures = [problem for problem in ended if problem not in OUTCOMES]
    assert not failures, f"{len(failures)} of {sum(ended.values())} cases failed:\n" + "\n".join(failures)
