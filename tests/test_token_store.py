"""Token stores (python -m titanlite.data.prepare), the global window order and dataset mixing."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch
from conftest import ROOT, logged_losses, run_titanlite, tensorboard_scalars

from titanlite.config_sections import DataSource
from titanlite.data.datasets import DataSpec, build_dataloader
from titanlite.data.documents import IndexedDocuments
from titanlite.data.global_order import MIX_BLOCK, block_counts
from titanlite.data.packing import PackedTokens
from titanlite.data.prepare import main as prepare_main
from titanlite.data.prepare import prepare
from titanlite.data.sample_corpus import sample_split
from titanlite.data.store import shard_paths
from titanlite.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
from titanlite.errors import UserError, sentence
from titanlite.train import main

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store") / "sample"
    prepare("sample", str(folder), documents_per_shard=20)
    return folder


def tokens_in_store(folder: Path) -> int:
    """The tokens of a store, from its manifest: the sample corpus is CPython's help topics, so it depends
    on the Python version (114,640 tokens on 3.11, more on 3.12)."""
    return json.loads((folder / "manifest.json").read_text())["tokens"]


def txt_folder(folder: Path, count: int, word: str) -> Path:
    folder.mkdir()
    for i in range(count):
        (folder / f"{i:03d}.txt").write_text(f"{word} {i} " * (5 + i % 7))
    return folder


def loader(path_or_mix, tokenizer, *, dp_rank=0, dp_world=1, batch=2, workers=0, seed=0):
    mix = path_or_mix if isinstance(path_or_mix, list) else []
    data = DataSpec("sample", "" if mix else str(path_or_mix), SEQ, batch, num_workers=workers, dataset_mix=mix)
    return build_dataloader(data, tokenizer, dp_rank, dp_world, seed)


def global_batches(make, world: int, batch: int, accum: int, steps: int) -> list[set]:
    """The windows (as token tuples) of each optimizer step when `world` ranks read `accum` micro-batches each."""
    iters = [iter(make(dp_rank=r, dp_world=world, batch=batch)) for r in range(world)]
    out = []
    for _ in range(steps):
        windows = set()
        for _ in range(accum):
            for it in iters:
                inputs, labels = next(it)
                windows |= {tuple(torch.cat([i[:1], lab]).tolist()) for i, lab in zip(inputs, labels)}
        out.append(windows)
    return out


def test_prepare_writes_the_sample_corpus_as_packing_tokenizes_it(sample_store, tokenizer):
    manifest = json.loads((sample_store / "manifest.json").read_text())
    texts = sample_split("train")
    assert manifest["documents"] == len(texts) == 69 and len(manifest["shards"]) == 4 and manifest["dtype"] == "uint16"
    tokens = np.concatenate([np.fromfile(shard_paths(sample_store, s)[0], dtype=np.uint16) for s in range(4)])
    expected = [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]
    assert manifest["tokens"] == len(tokens) and tokens.tolist() == expected
    assert np.load(shard_paths(sample_store, 1)[1])[-1] == manifest["shards"][1]["tokens"]


def test_store_windows_equal_the_raw_packed_windows(sample_store, tokenizer):
    """One rank: a store gives exactly the windows of the raw corpus, epoch after epoch."""
    raw = PackedTokens(IndexedDocuments(sample_split("train"), 0, 1, seed=3), tokenizer, SEQ, infinite=True)
    per_epoch = tokens_in_store(sample_store) // (SEQ + 1)
    batches = iter(loader(sample_store, tokenizer, batch=1, seed=3))
    for g, (inputs, labels) in zip(range(per_epoch + 50), iter(raw)):
        store_inputs, store_labels = next(batches)
        assert torch.equal(store_inputs[0], inputs) and torch.equal(store_labels[0], labels), g


def test_interrupted_prepare_keeps_finished_shards_and_redoes_the_rest(tmp_path, tokenizer):
    source = txt_folder(tmp_path / "txt", 30, "word")
    whole = tmp_path / "whole"
    prepare(str(source), str(whole), documents_per_shard=8)
    broken = tmp_path / "broken"
    shutil.copytree(whole, broken)
    # As a kill leaves it: no manifest, shard 2 half-written under its temporary name, shard 3 never begun.
    (broken / "manifest.json").unlink()
    for shard in (2, 3):
        for path in shard_paths(broken, shard):
            path.unlink()
    (broken / "shard-00002.bin.tmp").write_bytes(b"\1\2\3")
    (
        broken / "shard-00001.bin.xxh3"
    ).unlink()  # shard 1 as a titanlite before store checksums finished it: they are added
    finished = shard_paths(broken, 0)[0].stat().st_mtime_ns
    prepare(str(source), str(broken), documents_per_shard=8)
    assert shard_paths(broken, 0)[0].stat().st_mtime_ns == finished
    assert not list(broken.glob("*.tmp"))
    for name in sorted(p.name for p in whole.iterdir()):
        assert (broken / name).read_bytes() == (whole / name).read_bytes(), name


def test_prepare_cli_tokenizes_a_txt_folder_in_worker_processes(tmp_path):
    source = txt_folder(tmp_path / "txt", 12, "text")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanlite.data.prepare",
            "--input",
            str(source),
            "--output",
            str(tmp_path / "store"),
            "--workers",
            "2",
            "--documents_per_shard",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "12 documents" in done.stdout and "in 3 shards" in done.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanlite.data.prepare",
            "--input",
            str(tmp_path / "nothing.jsonl"),
            "--output",
            str(tmp_path / "x"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: --input {tmp_path / 'nothing.jsonl'} does not exist; point it at a .jsonl/.json/.parquet/.arrow/.txt "
        "file or a folder of such files"
    ]


@pytest.mark.parametrize(
    "argv, fault",
    [
        (["--output", "{out}/other"], "holds a store prepared with other arguments"),
        (["--output", "{out}/full"], "is a folder with other files in it"),
        (["--workers", "0"], "--workers (0) and --documents_per_shard (20000) must be at least 1"),
        (["--tokenizer", "{out}/none.model"], "the tokenizer file"),
    ],
)
def test_bad_prepare_arguments_are_one_sentence(tmp_path, capsys, argv, fault):
    prepare("sample_val", str(tmp_path / "other"), documents_per_shard=3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    argv = ["--input", "sample_val", "--output", str(tmp_path / "new"), *[a.format(out=tmp_path) for a in argv]]
    assert prepare_main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("error: ") and fault in line


def test_a_hub_dataset_that_cannot_be_streamed_is_one_sentence(tmp_path, monkeypatch):
    # Offline mode makes the hub client fail at once instead of retrying for ~20 s.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        UserError,
        match=r"--input allenai/c4 is no local file or folder and could not be streamed from the Hugging Face "
        r"hub \(.*\); check",
    ):
        prepare("allenai/c4", str(tmp_path / "c4"), hf_config="en")
    assert not (tmp_path / "c4").exists()


def test_a_store_from_another_tokenizer_names_both(sample_store, tmp_path):
    other = tmp_path / "tokenizer.model"
    other.write_bytes(SHIPPED_TOKENIZER.read_bytes() + b"\n")  # same ranks, another file
    with pytest.raises(
        UserError,
        match=rf"was prepared with the tokenizer {SHIPPED_TOKENIZER} \(sha256 \w+\) but this run uses {other}",
    ):
        loader(sample_store, load_tokenizer(other))


@pytest.mark.parametrize("world, batch, accum, workers", [(2, 2, 1, 0), (4, 1, 1, 0), (1, 2, 2, 2)])
def test_a_global_batch_holds_the_same_windows_for_any_layout(sample_store, tokenizer, world, batch, accum, workers):
    def make(**kw):
        return loader(sample_store, tokenizer, workers=workers, **kw)

    reference = global_batches(lambda **kw: loader(sample_store, tokenizer, **kw), 1, 4, 1, 5)
    assert global_batches(make, world, batch, accum, 5) == reference
    assert all(len(windows) == 4 for windows in reference)


def test_a_state_saved_on_two_ranks_resumes_on_one_and_back(sample_store, tokenizer):
    uninterrupted = global_batches(lambda **kw: loader(sample_store, tokenizer, **kw), 1, 4, 1, 6)
    two = [loader(sample_store, tokenizer, dp_rank=r, dp_world=2) for r in range(2)]
    iters = [iter(x) for x in two]
    for _ in range(2):
        for it in iters:
            next(it)
    state = two[1].state_dict()
    assert state == two[0].state_dict() and state["windows_consumed"] == 8
    one = loader(sample_store, tokenizer, batch=4)
    one.load_state_dict(state)
    it = iter(one)
    next(it)
    assert {tuple(torch.cat([i[:1], lab]).tolist()) for i, lab in zip(*next(it))} == uninterrupted[3]
    back = [loader(sample_store, tokenizer, dp_rank=r, dp_world=2) for r in range(2)]
    for x in back:
        x.load_state_dict(one.state_dict())
    assert global_batches(lambda dp_rank, **kw: back[dp_rank], 2, 2, 1, 2) == uninterrupted[4:6]
    odd = loader(sample_store, tokenizer, batch=3)
    with pytest.raises(UserError, match="consumed 16 windows, not a multiple of training.local_batch_size 3"):
        odd.load_state_dict(state | {"windows_consumed": 16})


def test_mix_weights_hold_in_every_block_and_resume_exactly(sample_store, tokenizer, tmp_path, caplog):
    raw = txt_folder(tmp_path / "raw", 10, "mixed")
    mix = [DataSource(str(sample_store), 3.0), DataSource(str(raw), 1.0)]
    assert block_counts([3.0, 1.0]).tolist() == [750, 250] and block_counts([1, 1, 1]).sum() == MIX_BLOCK
    with caplog.at_level("INFO"):
        reference = global_batches(lambda **kw: loader(mix, tokenizer, **kw), 1, 4, 1, 6)
    assert "training.dataset_mix weights sum to 4, not 1; normalised to 0.75, 0.25" in caplog.text
    raw_windows = sum(1 for step in reference for w in step if tokenizer.decode(list(w)).count("mixed"))
    assert 2 <= raw_windows <= 12  # 24 windows, a quarter of them from the raw folder
    two = [loader(mix, tokenizer, dp_rank=r, dp_world=2) for r in range(2)]
    global_batches(lambda dp_rank, **kw: two[dp_rank], 2, 2, 1, 3)
    one = loader(mix, tokenizer, batch=4)
    one.load_state_dict(two[0].state_dict())
    assert global_batches(lambda **kw: one, 1, 4, 1, 3) == reference[3:]
    seen = one.tokens_by_source()
    assert sum(seen.values()) == 24 * SEQ and list(seen) == ["0_sample", "1_raw"]
    assert seen["1_raw"] == SEQ * int(one.windows.windows_seen(24)[1])


@pytest.mark.parametrize(
    "mix, fault",
    [
        ([{"path": "{tmp}/missing", "weight": 1.0}], r"training.dataset_mix\[0\].path {tmp}/missing does not exist"),
        ([{"path": "", "weight": 1.0}], r"training.dataset_mix\[0\] has no path"),
        ([{"path": "{tmp}/empty", "weight": 1.0}], r"training.dataset_mix\[0\].path {tmp}/empty is a folder without"),
    ],
)
def test_a_missing_or_empty_mix_source_is_one_sentence(tokenizer, tmp_path, mix, fault):
    (tmp_path / "empty").mkdir()
    sources = [DataSource(e["path"].format(tmp=tmp_path), e["weight"]) for e in mix]
    with pytest.raises(UserError, match=fault.format(tmp=tmp_path)):
        loader(sources, tokenizer)
    with pytest.raises(UserError, match="training.dataset_mix is set together with training.dataset 'c4'"):
        build_dataloader(DataSpec("c4", "", SEQ, 1, dataset_mix=sources), tokenizer, 0, 1, 0)


def test_a_mix_trains_and_reports_tokens_per_source(sample_store, tmp_path, tiny_run):
    raw = txt_folder(tmp_path / "raw", 10, "mixed")
    mix = f'[{{ path = "{sample_store}", weight = 0.9 }}, {{ path = "{raw}", weight = 0.3 }}]'
    done = run_titanlite(
        [
            *tiny_run,
            "--training.dataset_mix",
            mix,
            "--training.steps",
            "12",
            "--metrics.enable_tensorboard",
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    assert done.returncode == 0, done.stderr
    losses = logged_losses(done.stderr)
    assert losses[12] < losses[1] - 0.5, losses
    assert "normalised to 0.75, 0.25" in done.stderr
    (summary,) = re.findall(r"data mix: 0_sample ([\d,]+) tokens \([\d.]+%\), 1_raw ([\d,]+) tokens", done.stderr)
    assert sum(int(n.replace(",", "")) for n in summary) == 12 * 2 * 64
    store_tokens = tensorboard_scalars(tmp_path / "tb", "data/tokens_seen/0_sample")
    raw_tokens = tensorboard_scalars(tmp_path / "tb", "data/tokens_seen/1_raw")
    assert store_tokens[12] + raw_tokens[12] == 12 * 2 * 64 and raw_tokens[12] > 0


@pytest.mark.extended
def test_training_resumes_exactly_from_two_ranks_on_one_and_one_on_two(sample_store, tmp_path):
    """fp32, global batch 4: 1 rank x 4, then 2 ranks x 2 from its step-2 checkpoint, then 1 rank from their step 4."""
    flags = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "4",
        "--training.steps",
        "6",
        "--training.dataset_path",
        str(sample_store),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]

    def run(folder: Path, nproc: int, local_batch: int, resume_from: Path | None = None) -> dict[int, float]:
        if resume_from is not None:
            shutil.copytree(resume_from, folder / "checkpoint" / resume_from.name)
        done = run_titanlite(
            [*flags, "--job.dump_folder", str(folder), "--training.local_batch_size", str(local_batch)], nproc=nproc
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return tensorboard_scalars(folder / "tb", "loss/train")

    reference = run(tmp_path / "one", 0, 4)
    assert reference[6] < reference[1]
    on_two = run(tmp_path / "two", 2, 2, resume_from=tmp_path / "one" / "checkpoint" / "step-2")
    back_on_one = run(tmp_path / "back", 0, 4, resume_from=tmp_path / "two" / "checkpoint" / "step-4")
    assert sorted(on_two) == [3, 4, 5, 6] and sorted(back_on_one) == [5, 6]
    for step, loss in {**on_two, **back_on_one}.items():
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    # The same job on the raw corpus instead of its store: the saved position is refused, not misread.
    raw = run_titanlite(
        [
            *flags,
            "--training.dataset_path",
            "",
            "--training.steps",
            "8",
            "--job.dump_folder",
            str(tmp_path / "back"),
            "--training.local_batch_size",
            "4",
        ]
    )
    assert raw.returncode == 2 and raw.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {tmp_path / 'back' / 'checkpoint' / 'step-6'} holds a data position for a token store or "
        "mix, but this "
        "run reads the other kind; resume with the training.dataset_path or dataset_mix it was saved with"
    )


def test_benchmark_prints_the_loader_tokens_per_second(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--loader", "--loader-seconds", "0.3", "--work-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rates = re.findall(r"\| token store, seq \d+, batch 8, \d workers \| ([\d,]+) \|", done.stdout)
    assert len(rates) == 3 and all(int(r.replace(",", "")) > 0 for r in rates), done.stdout


def test_validation_reads_a_store_in_one_finite_pass(sample_store, tokenizer):
    def pass_of(rank: int) -> list:
        finite = build_dataloader(
            DataSpec("sample_val", str(sample_store), SEQ, 4, infinite=False, section="validation"),
            tokenizer,
            rank,
            2,
            0,
        )
        first, again = list(finite), list(finite)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again)) and len(first) == len(again)
        return first

    batches = len(pass_of(0)) + len(pass_of(1))
    assert batches == (tokens_in_store(sample_store) // (SEQ + 1)) // 4


def edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def older_store(folder: Path) -> None:
    """The store as a titanlite without store checksums prepared it."""
    edit_manifest(folder, lambda m: [m.pop("checksums"), *(entry.pop("index_xxh3") for entry in m["shards"])])
    for sums in folder.glob("*.xxh3"):
        sums.unlink()


@pytest.mark.parametrize(
    "damage, fault",
    [
        (
            lambda f: edit_manifest(f, lambda m: m["shards"][0].update(tokens=m["shards"][0]["tokens"] + 5)),
            r"shard-00000.bin holds \d+ bytes but .*manifest.json says \d+ tokens",
        ),
        (
            lambda f: edit_manifest(f, lambda m: m.update(dtype="uint32")),
            "its dtype uint32 is not the one prepare writes",
        ),
        (
            lambda f: edit_manifest(f, lambda m: m.update(dtype="float16")),
            "its dtype 'float16' is not uint16 or uint32",
        ),
        (lambda f: edit_manifest(f, lambda m: m.pop("tokenizer")), r"its tokenizer record .* is missing or damaged"),
        (lambda f: edit_manifest(f, lambda m: m["shards"][1].update(documents="20")), "its shards list"),
        (
            lambda f: edit_manifest(f, lambda m: m["shards"][1].update(documents=19)),
            r"shard-00001.idx.npy holds int64 offsets of shape \(21,\)",
        ),
        (
            lambda f: edit_manifest(f, lambda m: m["shards"][0].update(max_id=70000)),
            "holds token id 70000 but its tokenizer has",
        ),
        (
            lambda f: (f / "shard-00001.bin").write_bytes((f / "shard-00001.bin").read_bytes()[:-6]),
            "shard-00001.bin holds",
        ),
        (
            lambda f: (f / "shard-00002.idx.npy").write_bytes(b"\x93NUMPY garbled"),
            "shard-00002.idx.npy does not match the checksum",
        ),
        (
            lambda f: older_store(f) or (f / "shard-00002.idx.npy").write_bytes(b"\x93NUMPY garbled"),
            "cannot be read as document offsets",
        ),
        (
            lambda f: (
                older_store(f) or np.save(f / "shard-00000.idx.npy", np.load(f / "shard-00000.idx.npy")[::-1].copy())
            ),
            "out of order",
        ),
        (lambda f: (f / "manifest.json").unlink(), "holds token-store shards but no manifest.json"),
        (lambda f: (f / "manifest.json").write_text("[1, 2]"), "is not a titanlite-token-store-1 manifest"),
    ],
)
def test_a_damaged_store_is_one_sentence_when_it_is_opened(sample_store, tokenizer, tmp_path, damage, fault):
    """Manifest and shards are checked against each other when the store opens (before step 1): sizes, dtype, index
    bounds, the tokenizer record and the largest id."""
    folder = tmp_path / "store"
    shutil.copytree(sample_store, folder)
    damage(folder)
    with pytest.raises(UserError, match=fault):
        loader(folder, tokenizer)


def test_a_store_prepared_before_max_id_was_recorded_is_scanned(sample_store, tokenizer, tmp_path):
    folder = tmp_path / "store"
    shutil.copytree(sample_store, folder)
    edit_manifest(folder, lambda m: [entry.pop("max_id") for entry in m["shards"]])
    assert next(iter(loader(folder, tokenizer)))[0].shape == (2, SEQ)
    tokens = np.fromfile(folder / "shard-00003.bin", dtype=np.uint16)
    tokens[7] = tokenizer.vocab_size
    tokens.tofile(folder / "shard-00003.bin")
    with pytest.raises(UserError, match=f"shard-00003.bin holds token id {tokenizer.vocab_size} but its tokenizer has"):
        loader(folder, tokenizer)


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1  # a token id one off: still a valid id, so only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("workers", [0, 2])
def test_bit_rot_inside_a_shard_stops_the_read_naming_the_file_and_bytes(sample_store, tokenizer, tmp_path, workers):
    """A chunk's checksum is verified the first time a process reads it, in DataLoader workers too."""
    folder = tmp_path / "store"
    shutil.copytree(sample_store, folder)
    flip_bit(folder / "shard-00001.bin", 70001)  # in its second, shorter chunk
    size = (folder / "shard-00001.bin").stat().st_size
    batches = iter(loader(folder, tokenizer, workers=workers))  # opens: sizes and offsets are fine
    with pytest.raises(UserError) as raised:
        for _ in range(500):
            next(batches)
    # A worker's error arrives wrapped in its traceback; the entry points print its sentence (the next test).
    assert re.match(
        rf"training.dataset_path: \S+shard-00001.bin bytes 65536..{size - 1} do not match their checksum in "
        r"shard-00001.bin.xxh3 \(recorded by prepare\): one of the two files changed on disk;",
        sentence(raised.value),
    )


def test_damage_a_worker_finds_ends_the_run_in_its_one_sentence(sample_store, tiny_run, tmp_path, capfd):
    """training.num_workers 1: the worker that reads a damaged chunk raises; the trainer prints its sentence, exit 2."""
    folder = tmp_path / "store"
    shutil.copytree(sample_store, folder)
    for shard in folder.glob("shard-*.bin"):  # every chunk damaged: the first window read is
        for offset in range(0, shard.stat().st_size, 65536):
            flip_bit(shard, offset)
    assert main([*tiny_run, "--training.dataset_path", str(folder), "--training.num_workers", "1"]) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and "Caught UserError" not in err and len(errors) == 1
    assert re.match(
        r"error: training.dataset_path: \S+shard-\d+.bin bytes 0..\d+ do not match their checksum", errors[0]
    )


def test_a_store_prepared_before_checksums_reads_unverified_and_says_so(sample_store, tokenizer, tmp_path, caplog):
    folder = tmp_path / "store"
    shutil.copytree(sample_store, folder)
    older_store(folder)
    with caplog.at_level("INFO", logger="titanlite"):
        batch = next(iter(loader(folder, tokenizer)))
    assert batch[0].shape == (2, SEQ)
    assert "was prepared before token stores recorded checksums: its shards are read unverified" in caplog.text
