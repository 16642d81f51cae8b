"""Chat data prepared into a token store with its loss mask (python -m titanlite.data.prepare --format chat):
a run reads the same windows from the store as from the records, and a store read with other settings
than it was made with, or prepared by an earlier titanlite, is one sentence."""

import json

import numpy as np
import pytest
import torch
from test_chat_data import CONVERSATIONS, folder, loader, tensors, write_records  # noqa: F401 (folder is a fixture)

from titanlite.data import prepare
from titanlite.data.store import mask_path
from titanlite.errors import UserError

RECORDS = [{"messages": m} for m in CONVERSATIONS * 6]


@pytest.fixture
def records(tmp_path):
    return write_records(tmp_path / "chat.jsonl", RECORDS)


def test_store_gives_the_windows_of_the_records(folder, records, tmp_path, capsys):  # noqa: F811
    store = tmp_path / "store"
    code = prepare.main(
        [
            "--input",
            str(records),
            "--output",
            str(store),
            "--tokenizer",
            str(folder),
            "--format",
            "chat",
            "--workers",
            "1",
            "--documents_per_shard",
            "5",
        ]
    )
    assert code == 0 and "12 documents" in capsys.readouterr().out
    assert mask_path(store, 2).is_file() and not mask_path(store, 3).is_file()  # 12 conversations, 5 per shard
    assert np.fromfile(mask_path(store, 0), dtype=np.uint8).any()
    from_records = list(loader(folder, records, 100, batch_size=1))
    from_store = list(loader(folder, store, 100, batch_size=1, num_workers=1))  # the memory maps travel to a worker
    assert len(from_records) == len(from_store) > 3
    for batch, store_batch in zip(from_records, from_store):
        assert all(torch.equal(mine, other) for mine, other in zip(tensors(batch), tensors(store_batch), strict=True))


def test_store_read_with_other_settings_is_one_sentence(folder, records, tmp_path):  # noqa: F811
    store = tmp_path / "store"
    assert (
        prepare.main(
            [
                "--input",
                str(records),
                "--output",
                str(store),
                "--tokenizer",
                str(folder),
                "--format",
                "chat",
                "--train_on",
                "all",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    with pytest.raises(
        UserError, match=r"was prepared with train_on 'all' \(this run: 'assistant'\); prepare it again"
    ):
        loader(folder, store, 40)
    with pytest.raises(
        UserError,
        match="holds chat data with its loss mask; set training.dataset_format chat and training.train_on all",
    ):
        loader(folder, store, 40, dataset_format="text")
    # a store prepared before the windows carried their conversations' starts records no version: prepared again
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["chat"].pop("version") == 2
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as refused:
        loader(folder, store, 40, train_on="all")
    assert str(refused.value) == (
        f"training.dataset_path {store} is a chat store prepared by an earlier titanlite (chat store "
        "version 1, this one reads 2); prepare it again with python -m titanlite.data.prepare "
        "--format chat --train_on all"
    )
    text_store = tmp_path / "text_store"
    (tmp_path / "docs.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"}\n')
    assert (
        prepare.main(
            [
                "--input",
                str(tmp_path / "docs.jsonl"),
                "--output",
                str(text_store),
                "--tokenizer",
                str(folder),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    with pytest.raises(
        UserError,
        match="holds text without a loss mask; prepare the records with python -m titanlite.data.prepare --format chat",
    ):
        loader(folder, text_store, 40)


def test_prepare_refuses_chat_flags_without_format(folder, records, tmp_path, capsys):  # noqa: F811
    code = prepare.main(
        ["--input", str(records), "--output", str(tmp_path / "s"), "--tokenizer", str(folder), "--train_on", "all"]
    )
    assert code == 2
    assert "--train_on and --chat_template apply to --format chat or prompt_completion" in capsys.readouterr().err
