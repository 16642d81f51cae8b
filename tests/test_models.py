import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from conftest import build_meta, materialize

from titanlite.errors import UserError
from titanlite.models import get_model_args, get_model_spec, list_model_specs
from titanlite.models.llama.args import ModelArgs, RopeScaling
from titanlite.models.llama.model import Attention, Transformer, rope_tables

EXPECTED_PARAMS = {
    ("llama3", "1B"): 1_235_814_400,
    ("llama3", "3B"): 3_212_749_824,
    ("llama3", "8B"): 8_030_261_248,
    ("llama3", "70B"): 70_553_706_496,
    ("llama3", "405B"): 405_853_388_800,
    ("llama2", "7B"): 6_738_415_616,
    ("llama2", "13B"): 13_015_864_320,
    ("llama2", "70B"): 68_976_648_192,
}


def small_args(**overrides) -> ModelArgs:
    """debugmodel with a tiny vocab and context, cheap enough for 2 CPU cores."""
    args = replace(get_model_args(get_model_spec("llama3"), "debugmodel"), vocab_size=97, n_layers=2, max_seq_len=32)
    return replace(args, **overrides)


@pytest.mark.parametrize("name, flavor", list(EXPECTED_PARAMS))
def test_param_counts(name, flavor):
    assert build_meta(name, flavor).num_params() == EXPECTED_PARAMS[name, flavor]


def test_405b_builds_on_meta_quickly():
    start = time.perf_counter()
    model = build_meta("llama3", "405B")
    assert time.perf_counter() - start < 10
    assert model.tok_embeddings.weight.is_meta


def test_flops_per_token_counts_matmul_params_and_attention():
    spec = get_model_spec("llama3")
    model = build_meta("llama3", "8B")
    args = model.args
    embedding = args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 2048
    assert spec.flops_per_token(model, 2048) == 6 * (8_030_261_248 - embedding) + attention
    # Tied: the shared matrix is the output projection, so nothing is subtracted.
    tied = build_meta("llama3", "1B")
    assert tied.num_params(exclude_embedding=True) == tied.num_params()


def test_forward_shape_and_dtype():
    args = small_args()
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    assert model(tokens).shape == (2, 16, args.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens).dtype == torch.bfloat16


def test_sequence_longer_than_max_seq_len_is_a_user_error():
    args = small_args()
    with pytest.raises(UserError, match="training.seq_len"):
        Transformer(args)(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))


def test_init_weights_after_meta_is_finite_and_deterministic():
    args = small_args()
    first, again, other = (
        materialize("llama3", args, seed=0),
        materialize("llama3", args, seed=0),
        materialize("llama3", args, seed=1),
    )
    for name, value in first.state_dict().items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, again.state_dict()[name]), name
    assert not torch.equal(first.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)
    assert torch.equal(first.layers["1"].ffn_norm.weight, torch.ones(args.dim))
    cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
    assert torch.equal(first.rope_cos, cos) and torch.equal(first.rope_sin, sin)


def test_init_stds():
    model = materialize("llama3", replace(small_args(), dim=512, n_heads=8, n_kv_heads=8, n_layers=8))
    block = model.layers["7"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.output.weight.std().item() == pytest.approx(512**-0.5, rel=0.05)


def test_tied_embeddings_share_one_weight():
    model = materialize("llama3", small_args(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = Transformer(small_args())
    assert model.num_params() == untied.num_params() - untied.output.weight.numel()


def naive_attention(attention: Attention, x, cos, sin, n_heads, n_kv_heads):
    """Attention written out head by head, with RoPE done in complex numbers."""
    batch, seq_len, dim = x.shape
    head_dim = dim // n_heads

    def heads(linear, n):
        return linear(x).view(batch, seq_len, n, head_dim)

    def rope(t):
        rotation = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None, :]
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * rotation).flatten(-2)

    q, k, v = rope(heads(attention.wq, n_heads)), rope(heads(attention.wk, n_kv_heads)), heads(attention.wv, n_kv_heads)
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    outputs = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / head_dim**0.5
        outputs.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[:, :, kv])
    return attention.wo(torch.cat(outputs, dim=-1))


def test_gqa_attention_matches_naive():
    torch.manual_seed(0)
    dim, n_heads, n_kv_heads, seq_len = 32, 4, 2, 7
    attention = Attention(dim, n_heads, n_kv_heads)
    x = torch.randn(2, seq_len, dim)
    cos, sin = rope_tables(dim // n_heads, seq_len, 10000.0, RopeScaling())
    expected = naive_attention(attention, x, cos, sin, n_heads, n_kv_heads)
    torch.testing.assert_close(attention(x, cos, sin, None), expected)


def test_rope_scaling_keeps_fast_and_slows_slow_frequencies():
    _, plain_sin = rope_tables(128, 2, 500000.0, None)
    _, scaled_sin = rope_tables(128, 2, 500000.0, RopeScaling(factor=8.0))
    plain, scaled = plain_sin[1].asin(), scaled_sin[1].asin()  # position 1: the angle is the frequency
    assert scaled[0] == pytest.approx(plain[0].item())  # wavelength 2*pi < 2048: unchanged
    assert scaled[-1] == pytest.approx(plain[-1].item() / 8, rel=1e-4)  # wavelength > 8192: divided


def test_causal_future_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    args = small_args()
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_compiles_without_graph_breaks():
    args = small_args()
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens))


def test_registry_lists_llama_families():
    assert {"llama2", "llama3"} <= {spec.name for spec in list_model_specs()}
    assert isinstance(get_model_spec("llama3").flavors["8B"], ModelArgs)


def test_unknown_model_name_suggests_closest():
    with pytest.raises(UserError, match=r"model.name 'lama3'.*did you mean 'llama3'.*llama2"):
        get_model_spec("lama3")


def test_unknown_flavor_suggests_closest():
    with pytest.raises(UserError, match=r"model.flavor '8b'.*did you mean '8B'.*405B"):
        get_model_args(get_model_spec("llama3"), "8b")


@pytest.mark.extended
def test_cli_table():
    result = subprocess.run([sys.executable, "-m", "titanlite.models"], capture_output=True, text=True, check=True)
    assert "8,030,261,248" in result.stdout and "405,853,388,800" in result.stdout
    assert "tokenizer" in result.stdout
