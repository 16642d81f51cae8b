"""Tokenizer, datasets and the stateful loader, on real files in tmp_path (CPU, a few seconds)."""

import base64
import json
import re

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import logged_losses, run_titanlite

from titanlite.config_sections import Model
from titanlite.data.datasets import DataParallelLoader, DataSpec, build_dataloader
from titanlite.data.documents import IndexedDocuments, StreamedDocuments
from titanlite.data.packing import PackedTokens
from titanlite.data.sample_corpus import sample_documents
from titanlite.data.tokenizer import SHIPPED_TOKENIZER, Tokenizer, build_tokenizer
from titanlite.errors import UserError, exit_code


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """Keep the Arrow caches `datasets` writes for local files out of the home folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def loader(tokenizer, *, dp_rank=0, dp_world=1, seed=0, **overrides):
    data = DataSpec(**{"dataset": "sample", "dataset_path": "", "seq_len": 16, "batch_size": 2, **overrides})
    return build_dataloader(data, tokenizer, dp_rank, dp_world, seed)


def take(batches, count: int) -> list:
    iterator = iter(batches)
    return [next(iterator) for _ in range(count)]


def assert_same_batches(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for (inputs, labels), (other_inputs, other_labels) in zip(expected, actual):
        assert torch.equal(inputs, other_inputs) and torch.equal(labels, other_labels)


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def numbered_texts(count: int) -> list[str]:
    return [f"document {i} says " + "lorem ipsum dolor " * (3 + i % 5) for i in range(count)]


# --- tokenizer -------------------------------------------------------------------------------


def test_round_trip_of_arbitrary_unicode(tokenizer):
    text = "Grüße, 世界! 🙂🚀 naïve café\t\tx = [1, 22, 333, 4444]\n\n\r\n  \x00 ﬁ e\u0301 اَلْعَرَبِيَّة" * 3
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == text


def test_bos_and_eos_follow_the_ranks_like_llama3(tokenizer):
    ids = tokenizer.encode("hello", bos=True, eos=True)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (2000, 2001, 2256)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.bos_id not in ids[1:-1] and tokenizer.eos_id not in ids[1:-1]


def test_special_token_text_is_encoded_as_plain_text(tokenizer):
    text = "a <|begin_of_text|> b <|end_of_text|> <|eot_id|>"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert max(ids) < 2000
    assert tokenizer.decode(ids) == text


def test_hand_made_tiktoken_file_loads(tmp_path):
    ranks = [bytes([byte]) for byte in range(256)] + [b"ab", b"abc"]
    path = tmp_path / "tiny.model"
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks)))
    tiny = Tokenizer(path)
    assert (tiny.vocab_size, tiny.bos_id, tiny.eos_id) == (258 + 256, 258, 259)
    assert tiny.encode("abc ab", bos=True, eos=False) == [258, 257, ord(" "), 256]


def test_shipped_tokenizer_compresses_the_sample_corpus():
    shipped = build_tokenizer(Model())
    assert shipped.vocab_size == 2256
    text = "".join(sample_documents())
    assert len(text.encode()) / len(shipped.encode(text, bos=False, eos=False)) > 3


def test_missing_tokenizer_names_the_path_and_the_key(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(UserError, match=re.escape(str(missing)) + ".*model.tokenizer_path"):
        build_tokenizer(Model(tokenizer_path=str(missing)))
    with pytest.raises(UserError, match="tokenizer.model.*model.hf_assets_path"):
        build_tokenizer(Model(hf_assets_path=str(tmp_path)))


def test_malformed_tokenizer_file_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("not base64 at all!\n")
    with pytest.raises(UserError, match=re.escape(str(bad)) + ".*line 1"):
        Tokenizer(bad)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A real SentencePiece BPE model made like Llama 2's (byte fallback, no normalisation, unk 0,
    bos 1, eos 2), from documents the test text below is not in."""
    import sentencepiece

    path = tmp_path_factory.mktemp("sentencepiece") / "tokenizer.model"
    with path.open("wb") as out:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter("\n".join(sample_documents()[:60]).splitlines()),
            model_writer=out,
            vocab_size=400,
            model_type="bpe",
            byte_fallback=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
        )
    return path


def test_a_sentencepiece_tokenizer_model_is_read_with_its_own_bos_and_eos(sentencepiece_model):
    sp = build_tokenizer(Model(tokenizer_path=str(sentencepiece_model)))
    assert (sp.vocab_size, sp.bos_id, sp.eos_id) == (400, 1, 2)
    text = sample_documents()[70] + " <s> and </s> are text here, and so is \u00e9\u6f22."
    ids = sp.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
    assert max(ids) < 400 and sp.decode(ids) == text  # byte fallback: nothing is lost


def test_llama2_trains_with_a_sentencepiece_tokenizer(tiny_run, sentencepiece_model):
    out = run_titanlite(tiny_run + ["--model.name", "llama2", "--model.tokenizer_path", str(sentencepiece_model)])
    assert out.returncode == 0, out.stderr
    assert "model llama2/debugmodel: " in out.stderr and "vocab 400 |" in out.stderr
    assert sorted(logged_losses(out.stderr)) == [1, 2, 3, 4]


def test_a_damaged_sentencepiece_file_is_one_sentence(tmp_path, sentencepiece_model):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(sentencepiece_model.read_bytes()[:3000])
    with pytest.raises(
        UserError, match=f"cannot use the tokenizer file {re.escape(str(bad))}: .*set model.tokenizer_path"
    ):
        build_tokenizer(Model(tokenizer_path=str(bad)))


# --- packing, sharding, epochs ---------------------------------------------------------------


def test_windows_pack_the_token_stream_without_overlap(tokenizer):
    source = IndexedDocuments(sample_documents()[:5], dp_rank=0, dp_world=1, seed=3)
    stream = [t for text, _ in source.documents(0, None) for t in tokenizer.encode(text, bos=True, eos=True)]
    windows = list(PackedTokens(source, tokenizer, seq_len=32, infinite=False))
    assert len(windows) == len(stream) // 33
    for i, (inputs, labels) in enumerate(windows):
        assert inputs.shape == labels.shape == (32,) and inputs.dtype == torch.long
        assert torch.equal(inputs[1:], labels[:-1])
        assert torch.cat([inputs, labels[-1:]]).tolist() == stream[i * 33 : (i + 1) * 33]


def test_ranks_read_disjoint_documents_that_cover_all():
    texts = numbered_texts(11)
    per_rank = [
        [
            text
            for text, _ in IndexedDocuments(texts, dp_rank=rank, dp_world=2, seed=0).documents(epoch=0, position=None)
        ]
        for rank in range(2)
    ]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(texts)


def test_ranks_of_a_loader_see_disjoint_txt_documents(tokenizer, tmp_path):
    for i, text in enumerate(numbered_texts(10)):
        (tmp_path / f"{i:02d}.txt").write_text(text)
    seen = []
    for rank in range(2):
        batches = loader(tokenizer, dataset_path=str(tmp_path), dp_rank=rank, dp_world=2, seq_len=8, infinite=False)
        tokens = [
            t for inputs, labels in batches for row in torch.cat([inputs, labels[:, -1:]], 1) for t in row.tolist()
        ]
        seen.append(set(re.findall(r"document (\d+)", tokenizer.decode(tokens))))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {str(i) for i in range(10)}


def test_data_loops_with_a_new_epoch(tokenizer):
    windows = PackedTokens(IndexedDocuments(numbered_texts(3), 0, 1, seed=0), tokenizer, seq_len=8, infinite=True)
    epoch_tokens = sum(len(tokenizer.encode(text, bos=True, eos=True)) for text in numbered_texts(3))
    iterator = iter(windows)
    for _ in range(epoch_tokens // 9 + 1):
        next(iterator)
    assert windows.state_dict()["epoch"] == 1


# --- exact resume ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_exactly_across_epochs(tokenizer, tmp_path, num_workers):
    path = write_jsonl(tmp_path / "docs.jsonl", numbered_texts(12))
    settings = dict(dataset_path=str(path), num_workers=num_workers)
    expected = take(loader(tokenizer, **settings), 40)  # several epochs of these 12 short documents
    interrupted = loader(tokenizer, **settings)
    take(interrupted, 17)
    state = interrupted.state_dict()
    resumed = loader(tokenizer, **settings)
    resumed.load_state_dict(state)
    assert_same_batches(expected[17:], take(resumed, 23))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_streamed_documents_resume_exactly(tokenizer, tmp_path, num_workers):
    """The c4 code path (a streamed Hugging Face dataset), fed from local shard files."""
    files = [str(write_jsonl(tmp_path / f"shard{i}.jsonl", numbered_texts(6 + i))) for i in range(4)]

    def streamed_loader():
        stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        windows = PackedTokens(StreamedDocuments(stream, "text", 0, 1), tokenizer, seq_len=16, infinite=True)
        return DataParallelLoader(windows, batch_size=2, num_workers=num_workers, layout={})

    expected = take(streamed_loader(), 40)
    interrupted = streamed_loader()
    take(interrupted, 13)
    resumed = streamed_loader()
    resumed.load_state_dict(interrupted.state_dict())
    assert_same_batches(expected[13:], take(resumed, 27))


def test_state_from_another_data_parallel_layout_is_refused(tokenizer):
    saved = loader(tokenizer, dp_world=2)
    take(saved, 1)
    with pytest.raises(UserError, match="dp_world=2.*dp_world=1"):
        loader(tokenizer).load_state_dict(saved.state_dict())


def test_sample_data_is_the_same_in_every_run(tokenizer):
    assert_same_batches(take(loader(tokenizer), 5), take(loader(tokenizer), 5))
    inputs, labels = take(loader(tokenizer, batch_size=3, seq_len=24), 1)[0]
    assert inputs.shape == labels.shape == (3, 24) and inputs.dtype == torch.long


# --- local files and errors ------------------------------------------------------------------


def first_window_text(tokenizer, **overrides) -> str:
    inputs, labels = take(loader(tokenizer, seq_len=64, batch_size=1, infinite=False, **overrides), 1)[0]
    return tokenizer.decode(inputs[0].tolist())


def test_local_jsonl_parquet_and_txt_folder(tokenizer, tmp_path):
    texts = numbered_texts(4)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", texts, field="body")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), parquet)
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text)
    for path, field in [(jsonl, "body"), (parquet, "text"), (folder, "text")]:
        decoded = first_window_text(tokenizer, dataset="local", dataset_path=str(path), text_field=field)
        assert decoded.startswith("<|begin_of_text|>document ")
        assert any(text.startswith(decoded[len("<|begin_of_text|>") :][:40]) for text in texts)


def test_wrong_text_field_names_the_fields_that_exist(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", numbered_texts(3))
    with pytest.raises(UserError, match="'content'.*id, text|'content'.*text, id"):
        loader(tokenizer, dataset_path=str(path), text_field="content")


def test_missing_dataset_path_names_the_key(tokenizer, tmp_path):
    with pytest.raises(UserError, match="training.dataset_path .*nowhere"):
        loader(tokenizer, dataset_path=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="training.dataset_path is empty"):
        loader(tokenizer, dataset="local")


def test_unknown_dataset_suggests_the_closest(tokenizer):
    with pytest.raises(UserError, match="did you mean sample"):
        loader(tokenizer, dataset="smaple")


def test_c4_offline_is_one_clear_sentence(tokenizer, monkeypatch):
    # Offline mode makes the hub client fail at once instead of retrying for ~20 s.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as caught:
        loader(tokenizer, dataset="c4")
    message = str(caught.value)
    assert "allenai/c4" in message and "training.dataset_path" in message
    assert "\n" not in message and ". " not in message


def test_synthetic_is_deterministic_and_resumable(tokenizer):
    expected = take(loader(tokenizer, dataset="synthetic", seed=7), 6)
    assert_same_batches(expected, take(loader(tokenizer, dataset="synthetic", seed=7), 6))
    other_rank = take(loader(tokenizer, dataset="synthetic", seed=7, dp_rank=1, dp_world=2), 1)
    assert not torch.equal(expected[0][0], other_rank[0][0])
    assert all(0 <= int(inputs.min()) and int(inputs.max()) < tokenizer.vocab_size for inputs, _ in expected)
    interrupted = loader(tokenizer, dataset="synthetic", seed=7)
    take(interrupted, 2)
    resumed = loader(tokenizer, dataset="synthetic", seed=7)
    resumed.load_state_dict(interrupted.state_dict())
    assert_same_batches(expected[2:], take(resumed, 4))


# --- faults in local files: one sentence naming the file and the fix ----------------------------


def local_fault(tokenizer, path) -> str:
    with pytest.raises(UserError) as caught:
        loader(tokenizer, dataset_path=str(path))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("training.dataset_path"), message
    return message


def test_text_field_that_is_not_a_string_names_the_record(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 5}\n')
    assert local_fault(tokenizer, path).endswith(
        f"{path} record 2 (counting from 1) holds 5 in 'text', not text; fix or remove that record"
    )


def test_record_without_the_text_field_names_the_record(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"body": "where is text?"}\n')
    assert "record 3 (counting from 1) has no 'text'" in local_fault(tokenizer, path)


@pytest.mark.parametrize(
    "name, loader_name", [("docs.parquet", "parquet"), ("docs.arrow", "arrow"), ("docs.json", "json")]
)
def test_file_that_is_not_what_its_suffix_says(tokenizer, tmp_path, name, loader_name):
    path = tmp_path / name
    path.write_text("just some words, not a data file {\n")
    assert f"{path} could not be read as {loader_name} (" in local_fault(tokenizer, path)


def test_text_that_is_not_utf8_is_refused_with_where(tokenizer, tmp_path):
    # Refused, not replaced: a Latin-1 file would otherwise train on replacement characters.
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "a.txt").write_text("plain words\n")
    (txt / "b.txt").write_bytes("line one\ncaf\u00e9 in Latin-1\n".encode("latin-1"))
    assert local_fault(tokenizer, txt).endswith(
        f"{txt / 'b.txt'} is not UTF-8 text (byte 0xe9 on line 2); re-encode it as UTF-8 or remove it"
    )
    inside_json = tmp_path / "docs.jsonl"
    inside_json.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert "record 2 (counting from 1) holds text in 'text' that is not UTF-8" in local_fault(tokenizer, inside_json)
    latin_json = tmp_path / "latin.jsonl"
    latin_json.write_bytes(b'\xff\xfe{"text": "a"}\n')
    assert "latin.jsonl is not UTF-8 text (byte 0xff on line 1)" in local_fault(tokenizer, latin_json)


def test_empty_files_and_folders_are_named(tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty.jsonl is empty (or only whitespace)" in local_fault(tokenizer, empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    assert "blank.jsonl is empty (or only whitespace)" in local_fault(tokenizer, blank)
    no_records = tmp_path / "none.json"
    no_records.write_text("[]")
    assert "none.json holds no records (a json file holding [] counts as empty)" in local_fault(tokenizer, no_records)
    folder = tmp_path / "nothing"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.md").write_text("not data")
    assert "is a folder without .jsonl/.json/.parquet/.arrow/.txt files" in local_fault(tokenizer, folder)


def test_folder_with_an_unreadable_file_names_that_file(tokenizer, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", numbered_texts(3))
    (tmp_path / "b.jsonl").write_text('{"text": "a record cut off in the middle\n')
    write_jsonl(tmp_path / "c.jsonl", numbered_texts(3))
    message = local_fault(tokenizer, tmp_path)
    assert f"training.dataset_path: {tmp_path / 'b.jsonl'} could not be read as json (" in message, message


@pytest.mark.parametrize(
    "name, content, fault",
    [
        (
            "docs.jsonl",
            '{"text": 5}\n',
            "record 1 (counting from 1) holds 5 in 'text', not text; fix or remove that record",
        ),
        (
            "docs.parquet",
            "not parquet\n",
            "could not be read as parquet (Parquet magic bytes not found in footer); fix or replace it",
        ),
        ("docs.jsonl", "", "is empty (or only whitespace); remove it or write the data into it"),
    ],
)
def test_issue_data_commands_end_in_one_sentence(tiny_run, tmp_path, capsys, monkeypatch, name, content, fault):
    """The data mistakes listed at the top of issue 13, through the trainer's main() in this process."""
    from titanlite.log import logger
    from titanlite.train import main

    monkeypatch.setattr(logger, "handlers", [])  # main's logger writes to this test's captured stderr only
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / name
    path.write_text(content)
    assert main(tiny_run + ["--training.dataset_path", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"error: training.dataset_path: {path} {fault}"


class DamagedWindows(torch.utils.data.Dataset):
    """Every item raises a UserError, as a damaged file read in a DataLoader worker does."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        raise UserError(f"training.dataset_path data.bin: window {index} is damaged; prepare the store again")


def read_in_a_worker() -> None:
    for _ in torch.utils.data.DataLoader(DamagedWindows(), num_workers=1):
        pass


def test_a_dataloader_workers_user_error_is_printed_as_its_one_sentence(capfd):
    """torch raises a worker's error again wrapped in its traceback; the entry points print only its sentence."""
    with pytest.raises(UserError, match="^Caught UserError in DataLoader worker process 0"):
        read_in_a_worker()
    assert exit_code(read_in_a_worker) == 2
    assert (
        capfd.readouterr().err
        == "error: training.dataset_path data.bin: window 0 is damaged; prepare the store again\n"
    )
