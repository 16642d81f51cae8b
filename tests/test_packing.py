"""Chat data packed best-fit-decreasing: windows close to full, every conversation once per epoch in one order at
any scale, each window carrying its conversations' document ids; a packed window's loss equals transformers' over
its conversations taken one by one, for ChatML (no bos) and a bos-led template; training.packing false and its
misuse."""

import json
import logging
import math
import re

import numpy as np
import pytest
import torch
from conftest import tensorboard_scalars
from qwen3_template import QWEN3_TEMPLATE
from test_chat_data import loader, tensors
from test_finetune_qwen3 import CHATS, QWEN3, transformers_assistant_loss

from titanlite.data.conversation_windows import PACK_BUFFER, ConversationWindows
from titanlite.data.global_order import GlobalOrderLoader
from titanlite.data.store import TokenStore
from titanlite.errors import UserError
from titanlite.examples.chat_example import write_tokenizer_folder
from titanlite.loss import IGNORED
from titanlite.train import main

transformers = pytest.importorskip("transformers")

SEQ_LEN = 512


def conversation_store(count: int, seed: int = 0) -> TokenStore:
    """`count` conversations of 50-150 random tokens, the second half of each trained."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 151, count)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(1, 1000, offsets[-1])
    mask = np.concatenate([np.arange(n) >= n // 2 for n in lengths]).astype(np.uint8)
    return TokenStore.from_offsets([tokens], [offsets], "synthetic", [mask])


def test_best_fit_fills_the_windows_and_every_conversation_is_read_once_per_epoch(caplog):
    caplog.set_level(logging.INFO, logger="titanlite")
    store = conversation_store(2 * PACK_BUFFER + 300)  # two full buffers and a part
    windows = ConversationWindows(store, SEQ_LEN, seed=3, pad_id=0, key="training.dataset_path")
    fill = re.search(r"an epoch is ([\d,]+) windows .* packed best-fit: the windows are (\d+)% full", caplog.text)
    per_epoch = int(fill.group(1).replace(",", ""))
    assert per_epoch == windows.windows_per_epoch() <= math.ceil(store.doc_len.sum() / (SEQ_LEN + 1)) / 0.9
    assert int(fill.group(2)) >= 97
    for epoch in range(2):
        order, starts = windows.plan(epoch)
        assert sorted(order.tolist()) == list(range(len(store.doc_len)))  # each conversation once
        assert all(store.doc_len[order[a:b]].sum() <= SEQ_LEN + 1 for a, b in zip(starts[:-1], starts[1:]))
    assert not np.array_equal(windows.plan(0)[0], windows.plan(1)[0])  # each epoch its own order
    # the buffer's windows are shuffled: the windows do not come longest-conversation first
    firsts = store.doc_len[windows.plan(0)[0][windows.plan(0)[1][:-1]]]
    assert not (np.diff(firsts[:100]) <= 0).all()
    again = ConversationWindows(store, SEQ_LEN, seed=3, pad_id=0, key="training.dataset_path")
    assert windows.windows_in(2.5) == again.windows_in(2.5)
    g = windows.windows_in(1) + 7  # a window of epoch 1, read cold by another instance
    inputs, labels, carried = again[g]
    documents = carried["document_ids"]
    mine = windows[g]
    assert (
        torch.equal(mine[0], inputs)
        and torch.equal(mine[1], labels)
        and torch.equal(mine[2]["document_ids"], documents)
    )
    # the document ids follow the conversations: each run of ids is one conversation, in the window's order
    order, starts = windows.plan(1)
    conversations = order[starts[7] : starts[8]]
    lengths = store.doc_len[conversations]
    expected = np.repeat(np.arange(len(lengths) + 1), [*lengths, SEQ_LEN + 1 - lengths.sum()])[:SEQ_LEN]
    assert documents.tolist() == expected.tolist()
    first = store.document(conversations[0], int(lengths[0]))[0]
    assert inputs[: len(first)].tolist() == first.tolist()
    # no label predicts a conversation's first token from the end of the one before
    assert all(labels[start - 1] == IGNORED for start in np.cumsum(lengths)[:-1])
    assert windows.epochs_at(g) == pytest.approx(1 + 7 / windows.epoch_windows[1])


def test_any_data_parallel_split_reads_the_windows_of_one_process():
    store = conversation_store(300)
    windows = ConversationWindows(store, SEQ_LEN, seed=0, pad_id=0, key="training.dataset_path")
    identity = {"packing": "best_fit"}

    def batches(rank, world, batch, count):
        loader = GlobalOrderLoader(
            windows,
            batch_size=batch,
            dp_rank=rank,
            dp_world=world,
            identity=identity,
            source_names=["s"],
            seq_len=SEQ_LEN,
        )
        it = iter(loader)
        return [tensors(next(it)) for _ in range(count)]

    one = batches(0, 1, 4, 3)  # 12 windows
    ranks = [batches(r, 2, 2, 3) for r in range(2)]
    for k in range(3):  # micro-batch k: rank 0's two windows, then rank 1's
        for part in range(3):  # inputs, labels, document ids
            assert torch.equal(one[k][part], torch.cat([ranks[0][k][part], ranks[1][k][part]]))


def test_packing_false_is_one_conversation_per_window(caplog):
    caplog.set_level(logging.INFO, logger="titanlite")
    store = conversation_store(40)
    windows = ConversationWindows(store, SEQ_LEN, seed=0, pad_id=0, key="training.dataset_path", packing=False)
    assert windows.windows_per_epoch() == 40
    assert "one conversation per window (training.packing false): the windows are 19% full" in caplog.text
    inputs, labels, carried = windows[5]
    documents = carried["document_ids"]
    length = int(store.doc_len[windows.plan(0)[0][5]])
    assert documents.tolist() == [0] * length + [1] * (SEQ_LEN - length)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One random Qwen3 saved twice by transformers: with Qwen3's ChatML template (no bos) and with a bos-led one
    (Llama's way: the template writes bos_token first), each with the chats."""
    root = tmp_path_factory.mktemp("packing")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, "max_position_embeddings": 512})).float()
    made = {}
    for name, bos, template in (
        ("chatml", None, QWEN3_TEMPLATE),
        ("bos", "<|begin_of_text|>", "{{ bos_token }}" + QWEN3_TEMPLATE),
    ):
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(write_tokenizer_folder(root / f"tok-{name}", bos_token=bos))
        )
        tokenizer.chat_template = template
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        made[name] = (root / name, template)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return made, data


@pytest.mark.parametrize(
    "name, device", [("chatml", "cpu"), ("bos", "cpu"), pytest.param("chatml", "cuda", marks=pytest.mark.cuda)]
)
def test_a_packed_window_has_the_loss_transformers_gives_its_conversations_one_by_one(
    folders, name, device, tmp_path, capsys
):
    """On the CPU the conversations are kept apart by the dense mask; on CUDA by FlexAttention's block mask, built
    from the carried document ids (ChatML: no bos to infer them from)."""
    (folder, template), data = folders[0][name], folders[1]
    flags = [
        "--job.device",
        device,
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(tmp_path),
        "--training.dataset_path",
        str(data),
        "--training.dataset_format",
        "chat",
        "--training.seq_len",
        "384",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--optimizer.lr",
        "0",
        "--validation.enable",
        "--validation.freq",
        "1",
        "--validation.dataset_path",
        str(data),
    ]  # lr 0: validation reads the same window with the same weights
    assert main(flags) == 0
    assert f"an epoch is 1 windows of 385 tokens, {len(CHATS)} conversations" in capsys.readouterr().err
    loss, trained = transformers_assistant_loss(folder, template)
    tolerance = 1e-5 if device == "cpu" else 1e-4
    assert tensorboard_scalars(tmp_path / "tb", "loss/train")[1] == pytest.approx(loss, abs=tolerance)
    assert tensorboard_scalars(tmp_path / "tb", "loss/validation")[1] == pytest.approx(loss, abs=tolerance)
    assert tensorboard_scalars(tmp_path / "tb", "data/trained_tokens")[1] == trained


def test_a_data_position_of_another_packing_is_refused(folders):
    """A checkpoint's data position counts windows of its packing: one saved by the greedy packing before best fit
    (no packing in its identity) or with training.packing false is another stream's."""
    (folder, _), data = folders[0]["chatml"], folders[1]
    packed = loader(folder, data, 384, batch_size=1, infinite=True)
    state = packed.state_dict()
    assert state["identity"]["packing"] == "best_fit"
    for identity in (
        {**state["identity"], "packing": "none"},
        {k: v for k, v in state["identity"].items() if k != "packing"},
    ):
        with pytest.raises(UserError, match=r"job.seed, training.seq_len and training.packing$"):
            packed.load_state_dict({**state, "identity": identity})
    unpacked = loader(folder, data, 384, batch_size=1, infinite=True, packing=False)
    with pytest.raises(UserError, match="'packing': 'best_fit'.* but this run reads .*'packing': 'none'"):
        unpacked.load_state_dict(state)


def test_packing_false_applies_to_chat_data_only(tiny_run, capsys):
    assert main([*tiny_run, "--training.packing", "false"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: training.packing false applies to training.dataset_format chat or prompt_completion, not text; "
        "leave training.packing at true"
    ]
