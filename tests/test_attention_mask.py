"""Attention inside documents (model.attention_mask block_causal, model.reset_position_ids): a packed
window trains exactly as its documents run one at a time, and causal attention is what it always was."""

import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, materialize

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.models import get_model_args, get_model_spec
from titanlite.models.attention import document_ids, document_positions
from titanlite.models.gpt2.parallelize import apply_tp as apply_gpt2_tp
from titanlite.models.llama.model import apply_rope
from titanlite.parallel.dims import ParallelDims

BOS, EOS = 0, 1  # the delimiters of these tests' token streams; text tokens are 2..96


def small_args(name: str, **overrides):
    args = replace(get_model_args(get_model_spec(name), "debugmodel"), vocab_size=97, n_layers=2, max_seq_len=64)
    return replace(args, **overrides)


def packed_windows(generator) -> torch.Tensor:
    """Two windows of 33 tokens cut from packed bos + text + eos documents: each starts inside a
    document (no bos) and ends inside another; the rows hold different boundaries."""
    rows = []
    for lengths in ((6, 9, 3, 20), (14, 2, 25)):
        stream = []
        for length in lengths:
            stream += [BOS, *torch.randint(2, 97, (length,), generator=generator).tolist(), EOS]
        rows.append(stream[3:36])  # drop the first document's bos and first tokens
    return torch.tensor(rows)


def test_document_ids_start_at_each_bos():
    tokens = torch.tensor([[5, 6, EOS, BOS, 7, EOS, BOS, 8], [BOS, 5, 6, EOS, BOS, BOS, EOS, 9]])
    assert document_ids(tokens, (BOS, EOS)).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 2, 2, 2]]
    assert document_ids(tokens, (BOS, EOS)).dtype == torch.int32
    assert document_ids(tokens, None) is None  # causal: nothing to compute


def test_one_delimiter_for_bos_and_eos_splits_between_the_pair():
    """GPT-2's <|endoftext|> ends one document and starts the next: the second of a pair starts one."""
    eot = 3
    tokens = torch.tensor([[5, eot, eot, 6, 7, eot, eot, 8], [eot, 5, 6, eot, eot, 7, eot, eot]])
    assert document_ids(tokens, (eot, eot)).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 2]]


def test_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]


CASES = {
    "llama3": ("llama3", {}),
    "llama3-reset-positions": ("llama3", {"reset_position_ids": True}),
    "mistral-window-inside-documents": ("mistral", {"sliding_window": 4}),
    "mixtral": ("mixtral", {}),
    "gpt2-reset-positions": ("gpt2", {"reset_position_ids": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_window_equals_its_documents_run_one_at_a_time(case):
    """Loss and gradients (fp32): the block-causal packed window vs the token-weighted sum over its
    documents, each run alone (plain causal, positions from 0). RoPE is relative, so llama needs no
    position reset; GPT-2's learned absolute positions do."""
    name, overrides = CASES[case]
    model = materialize(name, small_args(name, **overrides))
    windows = packed_windows(torch.Generator().manual_seed(0))
    inputs, labels = windows[:, :-1], windows[:, 1:]
    ids = document_ids(inputs, (BOS, EOS))

    packed_loss = F.cross_entropy(model(inputs, document_ids=ids).flatten(0, 1), labels.flatten())
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    token_losses = []
    for row in range(inputs.shape[0]):
        for doc in ids[row].unique():
            alone = ids[row] == doc
            logits = model(inputs[row, alone][None])
            token_losses.append(F.cross_entropy(logits[0], labels[row, alone], reduction="sum"))
    assert len(token_losses) == 7  # 4 + 3 documents: the mask really splits
    alone_loss = torch.stack(token_losses).sum() / labels.numel()
    alone_loss.backward()

    torch.testing.assert_close(packed_loss, alone_loss, rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_causal_attention_reads_across_documents_and_block_causal_does_not():
    model = materialize("llama3", small_args("llama3"))
    windows = packed_windows(torch.Generator().manual_seed(0))[:, :-1]
    changed = windows.clone()
    changed[:, 1] = (windows[:, 1] + 1 - 2) % 95 + 2  # a text token of each row's first document
    ids = document_ids(windows, (BOS, EOS))
    assert torch.equal(ids, document_ids(changed, (BOS, EOS)))
    later = ids != 0
    with torch.no_grad():
        assert not torch.allclose(model(windows)[later], model(changed)[later])
        assert torch.equal(model(windows, document_ids=ids)[later], model(changed, document_ids=ids)[later])


def attention_before_document_masks(attention, x, rope_cos, rope_sin, mask, window=None):
    """Llama's Attention.forward as it was before document masks (mask ignored), for bit-equality."""
    batch, seq_len, _ = x.shape
    rope_cos, rope_sin = rope_cos[:seq_len], rope_sin[:seq_len]  # the model hands over whole tables
    q = attention.wq(x).view(batch, seq_len, -1, attention.head_dim)
    k = attention.wk(x).view(batch, seq_len, -1, attention.head_dim)
    v = attention.wv(x).view(batch, seq_len, -1, attention.head_dim)
    q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if window is not None and seq_len > window:
        distance = torch.arange(seq_len)[:, None] - torch.arange(seq_len)[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(distance >= 0) & (distance < window))
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attention.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


def gpt2_attention_before_document_masks(attention, x, mask):
    batch, seq_len, _ = x.shape
    q, k, v = attention.wqkv(x).view(batch, seq_len, 3, -1, attention.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attention.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


@pytest.mark.parametrize("name", ["llama3", "mistral", "gpt2"])
def test_causal_logits_are_bit_identical_to_before(name):
    """model(tokens) with no document ids (attention_mask causal) runs exactly the SDPA calls of before:
    is_causal, or Mistral's [T, T] window mask (its debug window, 32, is shorter than these 48 tokens)."""
    model = materialize(name, small_args(name))
    tokens = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        now = model(tokens)
        for block in model.layers.values():
            if name == "gpt2":
                block.attention.forward = functools.partial(gpt2_attention_before_document_masks, block.attention)
            else:
                window = getattr(model.args, "sliding_window", None)
                block.attention.forward = functools.partial(
                    attention_before_document_masks, block.attention, window=window
                )
        before = model(tokens)
    assert torch.equal(now, before)


def test_reset_position_ids_needs_block_causal():
    assert load_config([]).model.attention_mask == "block_causal"
    with pytest.raises(UserError, match="model.reset_position_ids .* needs model.attention_mask block_causal"):
        load_config(["--model.attention_mask", "causal", "--model.reset_position_ids"])


def test_gpt2_refuses_reset_positions_under_tensor_parallelism():
    """Its position table is split by positions, which [B, T] per-document positions cannot use."""
    model = materialize("gpt2", small_args("gpt2", reset_position_ids=True))
    with pytest.raises(UserError, match="gpt2 with model.reset_position_ids and parallelism.tensor_parallel_degree 2"):
        apply_gpt2_tp(model, ParallelDims(dp_replicate=1, dp_shard=1, tp=2), loss_parallel=False)


def test_synthetic_tokens_are_attended_causally_and_the_run_says_so(caplog):
    """Random ids hold no documents: their stray bos ids must not cut windows (issue 17's benchmarks
    time causal attention on them); real text keeps its documents."""
    from titanlite.data.tokenizer import load_tokenizer
    from titanlite.models.attention import document_delimiters

    tokenizer = load_tokenizer(ROOT / "assets" / "tokenizer.model")
    assert document_delimiters("block_causal", tokenizer, "sample") == (tokenizer.bos_id, tokenizer.eos_id)
    assert "holds no documents" not in caplog.text
    with caplog.at_level("INFO", logger="titanlite"):
        assert document_delimiters("block_causal", tokenizer, "synthetic") is None
    assert "training.dataset synthetic holds no documents: attention is causal" in caplog.text
    assert document_delimiters("causal", tokenizer, "sample") is None
