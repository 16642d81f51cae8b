"""Hugging Face tokenizer folders: ids equal transformers.AutoTokenizer's for a byte-level BPE
tokenizer.json trained here (special tokens included), and bad folders are one-sentence errors."""

import json

import pytest
import transformers

from titanlite.config_sections import Model
from titanlite.data.hf_tokenizer import HFTokenizer
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.examples.chat_example import CHATML_TEMPLATE, write_tokenizer_folder

CHAT_TEMPLATE = CHATML_TEMPLATE
write_hf_folder = write_tokenizer_folder  # (folder, bos_token, chat_template, post_bos)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nWhat is a bee?<|im_end|>\n<|im_start|>assistant\nAn insect  that makes honey.<|im_end|>\n",
    "tabs\tand\nnewlines\n\n  and unicode: café, 日本語, emoji 🐝<|endoftext|>",
    "<|im_end|><|im_start|>",
]


@pytest.mark.parametrize("bos_token, post_bos", [(None, False), ("<|begin_of_text|>", True)])
def test_ids_equal_auto_tokenizer(tmp_path, bos_token, post_bos):
    folder = write_hf_folder(tmp_path / "tok", bos_token, post_bos=post_bos)
    ours = build_tokenizer(Model(hf_assets_path=str(folder)))
    assert isinstance(ours, HFTokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.vocab_size == len(theirs)
    assert ours.eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>")
    assert ours.bos_id == (theirs.bos_token_id if bos_token else ours.eos_id)
    for text in TEXTS:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, bos=False, eos=False) == expected
        assert ours.encode(text, bos=True, eos=True) == [ours.bos_id] + expected + [ours.eos_id]
        assert ours.decode(expected) == theirs.decode(expected)
        if post_bos:  # the folder's own post-processor agrees with bos=True
            assert theirs(text)["input_ids"] == ours.encode(text, bos=True, eos=False)
    # the special tokens are single ids, not spelled out
    assert ours.encode("<|im_start|>", bos=False, eos=False) == [theirs.convert_tokens_to_ids("<|im_start|>")]
    assert ours.chat_template == CHAT_TEMPLATE


def test_tokenizer_json_path_and_tokenizer_path(tmp_path):
    folder = write_hf_folder(tmp_path / "tok")
    by_file = build_tokenizer(Model(tokenizer_path=str(folder / "tokenizer.json")))
    by_folder = build_tokenizer(Model(tokenizer_path=str(folder)))
    assert by_file.encode(TEXTS[1], True, True) == by_folder.encode(TEXTS[1], True, True)


def one_sentence(error: UserError) -> str:
    message = str(error)
    assert "\n" not in message and message.count(". ") == 0
    return message


def test_broken_folders_are_one_sentence(tmp_path):
    folder = write_hf_folder(tmp_path / "tok")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError) as caught:
        build_tokenizer(Model(hf_assets_path=str(folder)))
    assert "tokenizer.json" in one_sentence(caught.value) and "model.hf_assets_path" in str(caught.value)

    with pytest.raises(UserError) as caught:
        HFTokenizer(tmp_path / "missing" / "tokenizer.json", "model.tokenizer_path")
    assert "does not exist" in one_sentence(caught.value)

    folder = write_hf_folder(tmp_path / "tok2")
    (folder / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(UserError) as caught:
        build_tokenizer(Model(hf_assets_path=str(folder)))
    assert "tokenizer_config.json" in one_sentence(caught.value)

    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(UserError, match="<|nope|>.*make the two files agree"):
        build_tokenizer(Model(hf_assets_path=str(folder)))

    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(UserError, match="names no eos_token"):
        build_tokenizer(Model(hf_assets_path=str(folder)))


def test_prepared_store_equals_the_raw_files(tmp_path):
    """python -m titanlite.data.prepare with --tokenizer a Hugging Face folder: the store holds bos + ids + eos."""
    from titanlite.data.prepare import prepare
    from titanlite.data.store import open_store

    folder = write_hf_folder(tmp_path / "tok", "<|begin_of_text|>")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    prepare(str(data), str(tmp_path / "store"), tokenizer_path=str(folder))
    tokenizer = build_tokenizer(Model(hf_assets_path=str(folder)))
    store = open_store(str(tmp_path / "store"), tokenizer, "training.dataset_path")
    stored = [list(store.shards[0][start : start + length]) for start, length in zip(store.doc_start, store.doc_len)]
    assert stored == [tokenizer.encode(text, bos=True, eos=True) for text in TEXTS]
