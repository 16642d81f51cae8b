"""Every file titanlite reads, damaged on purpose with a fixed seed, read back by the function training (or convert)
opens it with: a token store (text and chat), chat records (jsonl, parquet), a chat template, a Hugging Face folder
written by transformers (config.json, model.safetensors, tokenizer.json), a DCP checkpoint of an in-process run with
its checksums and lineage (rewound.json, the dump-folder lock), and the run's config.toml. The damage and the verdict
are tests/corruption.py's: a sentence naming the file, or exactly the undamaged read; never a traceback.
"""

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import DEBUG_CONFIG, ON_CPU
from corruption import OUTCOMES, Target, run_cases

from titanlite.errors import UserError

SEED = int(os.environ.get("FUZZ_SEED", 20261128))  # fixed; another only to explore by hand


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
        fields = {
            key: str(folder / value)
            if key in ("dataset_path", "chat_template") and value and not Path(value).is_absolute()
            else value
            for key, value in spec.items()
        }
        fields.setdefault("dataset_path", str(folder))
        fields.setdefault("seq_len", SEQ)
        return loader_digest(
            build_dataloader(DataSpec("sample", batch_size=8, infinite=False, **fields), tokenizer, 0, 1, 0)
        )

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
    return (
        cfg.model.name,
        cfg.model.flavor,
        repr(model_folder.args),
        tokenizer.vocab_size,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.encode("What does Python's help say?", bos=True, eos=True),
        tensors_digest(state.values()),
    )


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
        from titanlite.build import build_run
        from titanlite.config import load_config
        from titanlite.data.datasets import build_dataloader, training_data
        from titanlite.optim import build_lr_scheduler, build_optimizer
        from titanlite.parallel.dist import init_distributed

        self.cfg = cfg = load_config(flags)
        self.run = build_run(cfg, init_distributed("cpu", 60))
        self.optimizer = build_optimizer(self.run.model, cfg.optimizer, "cpu")
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(training_data(cfg.training), self.run.tokenizer, 0, 1, cfg.job.seed)

    def reader(self, load_step: int) -> Callable[[Path], tuple]:
        def read(folder: Path) -> tuple:
            from conftest import checkpointed_training

            from titanlite.checkpoint.manager import CheckpointManager

            self.cfg.job.dump_folder, self.cfg.checkpoint.load_step = str(folder), load_step
            for tensor in self.run.model.parameters():  # what a load leaves unset must show in the digest
                tensor.data.fill_(float("nan"))
            manager = CheckpointManager(
                self.run, checkpointed_training(self.optimizer, self.scheduler, self.dataloader)
            )
            try:
                state = manager.load()
            finally:
                manager.close()
            optimizer = self.optimizer.state_dict()["state"]
            return (
                state.step,
                state.tokens_seen,
                tensors_digest(self.run.model.state_dict().values()),
                tensors_digest(t for by_name in optimizer.values() for t in by_name.values()),
                repr(self.dataloader.state_dict()),
            )

        return read


def write_data(root: Path) -> Path:
    """The data inputs under root: chat records (jsonl, parquet), a template, a text store and a chat store, and
    the Hugging Face tokenizer folder they use; returns that folder."""
    import pyarrow
    import pyarrow.parquet

    from titanlite.data.prepare import prepare
    from titanlite.data.sample_corpus import sample_split
    from titanlite.examples.chat_example import CHATML_TEMPLATE, chat_records, write_tokenizer_folder

    tokenizer_folder = write_tokenizer_folder(root / "tokenizer")
    records = chat_records(12)
    for name, write in (
        ("jsonl", lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in records))),
        ("parquet", lambda p: pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), p)),
    ):
        (root / name).mkdir()
        write(root / name / f"chats.{name}")
    (root / "template").mkdir()
    (root / "template" / "chat.jinja").write_text(CHATML_TEMPLATE)
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_split("train")[:12]))
    prepare(str(root / "texts.jsonl"), str(root / "store"), documents_per_shard=6)
    prepare(
        str(root / "jsonl" / "chats.jsonl"),
        str(root / "chat_store"),
        str(tokenizer_folder),
        dataset_format="chat",
        documents_per_shard=6,
    )
    return tokenizer_folder


def write_model_files(root: Path, tokenizer_folder: Path, vocab_size: int) -> list[str]:
    """A tiny Hugging Face folder written by transformers, and a dump folder of an in-process run with step-1 and step-2
    checkpoints, a rewound.json (to step 1), its config.toml and a live lock; returns the run's flags."""
    import gc

    from titanlite.checkpoint.folders import REWOUND
    from titanlite.checkpoint.lock import take_lock
    from titanlite.train import main

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, root / "hf" / name)
    flags = [
        *ON_CPU,
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(root / "dump"),
        "--model.n_layers",
        "1",
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        "--metrics.log_freq",
        "1",
    ]
    assert main(flags) == 0
    gc.enable()  # the trainer leaves it off
    (root / "dump" / "checkpoint" / REWOUND).write_text(json.dumps({"step": 1, "at": "2026-11-28 09:00:00"}))
    (root / "toml").mkdir()
    shutil.copy(root / "dump" / "config.toml", root / "toml" / "config.toml")
    (root / "lock").mkdir()
    take_lock(root / "lock")
    return flags


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
    from titanlite.parallel.dist import close_distributed

    root = tmp_path_factory.mktemp("fuzz")
    tokenizer_folder = write_data(root)
    hf_tokenizer, shipped = load_tokenizer(tokenizer_folder), load_tokenizer(SHIPPED_TOKENIZER)
    flags = write_model_files(root, tokenizer_folder, hf_tokenizer.vocab_size)
    checkpoint = CheckpointReader(flags)
    chat = dict(dataset_format="chat", seq_len=256)  # a window holds a conversation
    step = "checkpoint/step-2"
    yield [
        (
            Target(
                "store",
                root / "store",
                ["manifest.json", "shard-00000.bin", "shard-00000.bin.xxh3", "shard-00000.idx.npy", "shard-00001.bin"],
                loader_reader(shipped),
            ),
            4,
            STRAY_STORE,
        ),
        (
            Target(
                "chat_store",
                root / "chat_store",
                [
                    "manifest.json",
                    "shard-00000.bin",
                    "shard-00000.mask.bin",
                    "shard-00000.mask.bin.xxh3",
                    "shard-00001.idx.npy",
                ],
                loader_reader(hf_tokenizer, **chat),
            ),
            4,
            STRAY_STORE,
        ),
        (
            Target(
                "jsonl",
                root / "jsonl",
                ["chats.jsonl"],
                loader_reader(hf_tokenizer, dataset_path="chats.jsonl", **chat),
                ("chats.jsonl",),
            ),
            4,
            ["notes.txt"],
        ),
        (
            Target(
                "parquet",
                root / "parquet",
                ["chats.parquet"],
                loader_reader(hf_tokenizer, dataset_path="chats.parquet", **chat),
                ("chats.parquet",),
            ),
            3,
            ["notes.txt"],
        ),
        (
            Target(
                "template",
                root / "template",
                ["chat.jinja"],
                loader_reader(
                    hf_tokenizer, dataset_path=str(root / "jsonl" / "chats.jsonl"), chat_template="chat.jinja", **chat
                ),
                ("chat.jinja",),
            ),
            3,
            ["notes.txt"],
        ),
        (
            Target(
                "hf",
                root / "hf",
                ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"],
                read_hf_folder,
                ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"),
            ),
            4,
            ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "notes.txt", "pytorch_model.bin"],
        ),
        (
            Target(
                "checkpoint",
                root / "dump",
                [f"{step}/__0_0.distcp", f"{step}/.metadata", f"{step}/checksums/rank0.json"],
                checkpoint.reader(-1),
            ),
            3,
            [
                f"{step}/__1_0.distcp",
                f"{step}/notes.txt",
                f"{step}/checksums/rank1.json",
                "checkpoint/step-3/.metadata",
            ],
        ),
        (
            Target(
                "convert",
                root / "dump",
                [f"{step}/__0_0.distcp", f"{step}/.metadata", f"{step}/checksums/rank0.json"],
                read_converted,
            ),
            2,
            [f"{step}/notes.txt"],
        ),
        # Deleting rewound.json is how a user rewinds again (folders.py), not damage.
        (
            Target(
                "lineage",
                root / "dump",
                ["checkpoint/rewound.json"],
                checkpoint.reader(1),
                kinds=("truncate", "flip", "retype"),
            ),
            3,
            ["checkpoint/notes.txt"],
        ),
        # The lock of a live run: a pid flipped into another is a run gone as far as anyone can tell, and a deleted
        # lock no lock; a damaged record must still hold the folder (it ages into staleness).
        (
            Target("lock", root / "lock", [".titanlite.lock"], read_lock, kinds=("truncate", "retype")),
            4,
            ["notes.txt", ".titanlite.partial"],
        ),
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
            print(
                f"  {target.name}: "
                + ", ".join(f"{count} {how}" for how, count in by_target.items() if how in OUTCOMES)
            )
            ended += by_target
        print(f"  {sum(ended.values())} cases")
    failures = [problem for problem in ended if problem not in OUTCOMES]
    assert not failures, f"{len(failures)} of {sum(ended.values())} cases failed:\n" + "\n".join(failures)


def edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.unlink()  # a new file: the case folder shares the fixture's big files as hard links
    path.write_text(json.dumps(document))


def parquet_with_invalid_utf8(path: Path) -> None:
    """A chat record whose answer's bytes are not UTF-8 (as a flipped byte in a data page leaves it)."""
    import pyarrow
    import pyarrow.parquet

    content = pyarrow.array([b"Hello?", b"\xffHi."], pyarrow.binary()).view(pyarrow.string())
    turns = pyarrow.StructArray.from_arrays([pyarrow.array(["user", "assistant"]), content], names=["role", "content"])
    path.unlink()
    pyarrow.parquet.write_table(
        pyarrow.table({"messages": pyarrow.ListArray.from_arrays(pyarrow.array([0, 2], pyarrow.int32()), turns)}), path
    )


FOUND = {  # the damage of each defect the fuzzer found (on other seeds too), kept as a case of its own
    ("hf", "config.json"): lambda p: edit_json(p, lambda c: c.update(architectures=7)),
    ("parquet", "chats.parquet"): parquet_with_invalid_utf8,
    ("lock", ".titanlite.lock"): lambda p: edit_json(p, lambda c: c.update(pid="seven")),
    ("lineage", "checkpoint/rewound.json"): lambda p: edit_json(p, lambda c: c.update(step="1")),
    ("checkpoint", "checkpoint/step-2/.metadata"): lambda p: p.unlink(),
    ("checkpoint", "checkpoint/step-2/checksums/rank0.json"): lambda p: edit_json(
        p, lambda sums: sums.update({"__7_0.distcp": sums.pop("__0_0.distcp")})
    ),
}


def test_the_damage_the_fuzzer_found_stays_refused(targets, tmp_path):
    """Before their fixes: a TypeError (architectures), a UnicodeDecodeError as the records were read,
    a ValueError (the lock's pid), a second rewind, a silent resume from step-1, a sentence naming the wrong file."""
    from corruption import copy_folder, judge

    by_name, wrong = {target.name: target for target, _, _ in targets}, []
    for (name, relative), damage in FOUND.items():
        target, relative, folder = by_name[name], relative.strip(), tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
        copy_folder(target.folder, folder)
        damage(folder / relative)
        how, problem = judge(target, relative, "retype", "(the case found)", folder, target.read(target.folder))
        # the lock reads the same: still held by the live run ("in use"), as undamaged
        if problem or how != ("read the same" if name == "lock" else "refused naming the file"):
            wrong.append(f"{name} {relative}: {how}: {problem}")
    assert not wrong, "\n".join(wrong)
