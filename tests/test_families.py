"""The Mistral, Mixtral and GPT-2 families: sizes, the sliding window, expert routing and compute,
FSDP on 2 ranks, and the Hugging Face adapters."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import ON_CPU, build_meta, materialize, tensorboard_scalars
from test_pipeline_parallel import launch

from titanlite.errors import UserError
from titanlite.models import get_model_args, get_model_spec
from titanlite.models.attention import attention_mask, window_mask
from titanlite.models.llama.model import Attention, TransformerBlock, rope_tables
from titanlite.models.moe import (
    MoE,
    _grouped_swiglu,
    _looped_swiglu,
    assignments_per_sequence,
    experts_forward,
    load_balancing_loss,
    softmax_then_topk,
    softmax_topk,
)

EXPECTED_PARAMS = {
    ("mistral", "7B"): 7_241_732_096,
    ("mistral", "mathstral-7B"): 7_248_023_552,
    ("mixtral", "8x7B"): 46_702_792_704,
    ("gpt2", "124M"): 124_439_808,
    ("gpt2", "355M"): 354_823_168,
    ("gpt2", "774M"): 774_030_080,
    ("gpt2", "1.5B"): 1_557_611_200,
    ("gpt2", "2.6B"): 2_648_931_840,
}
FAMILIES = ("mistral", "mixtral", "gpt2")


def small_args(name: str, **overrides):
    """The family's debugmodel with a tiny vocab, two layers and a short context."""
    args = replace(get_model_args(get_model_spec(name), "debugmodel"), vocab_size=97, n_layers=2, max_seq_len=64)
    return replace(args, **overrides)


# --- sizes and FLOPs ---


@pytest.mark.parametrize("name, flavor", list(EXPECTED_PARAMS))
def test_param_counts(name, flavor):
    assert build_meta(name, flavor).num_params() == EXPECTED_PARAMS[name, flavor]


def test_mixtral_mfu_counts_the_active_experts():
    spec = get_model_spec("mixtral")
    model = build_meta("mixtral", "8x7B")
    args = model.args
    idle = 32 * (8 - 2) * 3 * 4096 * 14336  # 6 of 8 experts in each of 32 blocks
    active = 46_702_792_704 - idle
    assert active == 12_879_925_248 == model.num_params(active=True)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert spec.flops_per_token(model, 4096) == 6 * (active - 32000 * 4096) + attention


def test_mistral_attention_flops_stop_at_the_window():
    flops = get_model_spec("mistral").flops_per_token
    mistral, mathstral = build_meta("mistral", "7B"), build_meta("mistral", "mathstral-7B")
    assert flops(mistral, 8192) == flops(mistral, 4096) > flops(mistral, 2048)
    assert flops(mathstral, 8192) > flops(mathstral, 4096)


def test_gpt2_flops_exclude_only_the_position_table():
    model = build_meta("gpt2", "124M")
    # Tied: the token matrix is also the output projection, a matmul; the positions are a lookup.
    assert model.num_params(exclude_embedding=True) == 124_439_808 - 1024 * 768
    assert get_model_spec("gpt2").flops_per_token(model, 1024) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024


# --- Mistral: the sliding window ---


def test_sliding_window_mask():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(window_mask(5, 2, torch.device("cpu")), expected)


def plain_masked_attention(attention: Attention, x, cos, sin, window: int):
    """Softmax attention written out with a mask built from its definition, head by head."""
    batch, seq_len, dim = x.shape
    n_heads = attention.wq.out_features // attention.head_dim
    n_kv_heads = attention.wk.out_features // attention.head_dim
    from titanlite.models.llama.model import apply_rope

    q = apply_rope(attention.wq(x).view(batch, seq_len, n_heads, -1), cos, sin)
    k = apply_rope(attention.wk(x).view(batch, seq_len, n_kv_heads, -1), cos, sin)
    v = attention.wv(x).view(batch, seq_len, n_kv_heads, -1)
    allowed = torch.tensor([[0 <= i - j < window for j in range(seq_len)] for i in range(seq_len)])
    outputs = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv_heads)
        scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / attention.head_dim**0.5
        outputs.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, :, kv])
    return attention.wo(torch.cat(outputs, dim=-1))


@pytest.mark.parametrize("seq_len", [11, 4], ids=["longer-than-window", "within-window"])
def test_sliding_window_attention_matches_plain_masked_attention(seq_len):
    torch.manual_seed(0)
    dim, n_heads, n_kv_heads, window = 32, 4, 2, 4
    attention = Attention(dim, n_heads, n_kv_heads)
    x = torch.randn(2, seq_len, dim)
    cos, sin = rope_tables(dim // n_heads, seq_len, 10000.0, None)
    mask = attention_mask(None, window, torch.device("cpu"))  # the window alone: attend makes its [T, T] mask
    torch.testing.assert_close(attention(x, cos, sin, mask), plain_masked_attention(attention, x, cos, sin, window))


def test_tokens_further_back_than_the_window_are_not_attended():
    torch.manual_seed(0)
    args = small_args("mistral", n_layers=1, sliding_window=4)
    model = materialize("mistral", args)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    # One layer: position i reads positions i-3..i, so token 0 reaches positions 0..3 only.
    assert not torch.allclose(before[0, 3], after[0, 3])
    torch.testing.assert_close(before[0, 4:], after[0, 4:], rtol=0, atol=0)


def test_mistral_is_the_llama_decoder_with_a_window():
    model = materialize("mistral", small_args("mistral"))
    assert all(type(block) is TransformerBlock for block in model.layers.values())
    assert model.args.sliding_window == 32
    llama_spec = get_model_spec("llama3")
    with torch.device("meta"):
        llama = llama_spec.model_cls(replace(get_model_args(llama_spec, "debugmodel"), vocab_size=97))
    assert {k for k in model.state_dict() if k.startswith("layers.0.")} == {
        k for k in llama.state_dict() if k.startswith("layers.0.")
    }
    assert get_model_args(get_model_spec("mistral"), "mathstral-7B").sliding_window is None


# --- Mixtral: routing, balance loss, expert compute ---


def test_route_picks_the_top2_and_weights_sum_to_one():
    torch.manual_seed(0)
    logits = torch.randn(50, 8)
    weights, experts = softmax_topk(logits, 2)
    assert torch.equal(experts.sort(-1).values, logits.topk(2).indices.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    # Mixtral's rule: softmax over all experts, renormalised over the chosen two.
    probs = logits.softmax(-1).gather(-1, experts)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))


def test_softmax_then_topk_hand_checked():
    # Qwen3 MoE: probabilities (0.5, 0.3, 0.2) over three experts, top-2 -> experts 0, 1 with
    # weights (0.5, 0.3), renormalised to (0.625, 0.375) under norm_topk_prob.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    weights, experts = softmax_then_topk(logits, 2, norm_topk_prob=False)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.3]]))
    weights, _ = softmax_then_topk(logits, 2, norm_topk_prob=True)
    torch.testing.assert_close(weights, torch.tensor([[0.625, 0.375]]))
    # Renormalised, it picks and weighs exactly as Mixtral's softmax over the top-k logits.
    torch.manual_seed(0)
    logits = torch.randn(50, 8)
    for got, want in zip(softmax_then_topk(logits, 2), softmax_topk(logits, 2)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="router 'sigmoid' is not one of softmax_topk, softmax_then_topk"):
        MoE(8, 16, 4, 2, router="sigmoid")


def test_balance_loss_hand_checked():
    # Two tokens, three experts, top-2. Router probabilities (0.6, 0.3, 0.1) and (0.1, 0.3, 0.6):
    # assignments {0, 1} and {2, 1}, so f = (1/4, 2/4, 1/4); P = (0.35, 0.3, 0.35);
    # loss = 3 * (0.25 * 0.35 + 0.5 * 0.3 + 0.25 * 0.35) = 0.975.
    logits = torch.tensor([[[6.0, 3.0, 1.0], [1.0, 3.0, 6.0]]]).log()
    weights, experts = softmax_topk(logits, 2)
    torch.testing.assert_close(weights[0, 0], torch.tensor([2 / 3, 1 / 3]))
    assert load_balancing_loss(logits, assignments_per_sequence(experts, 3)).item() == pytest.approx(0.975)
    # Top-1, both tokens to expert 0 with probability 0.75: 2 * (1 * 0.75 + 0 * 0.25) = 1.5.
    lopsided = torch.tensor([[[3.0, 1.0], [3.0, 1.0]]]).log()
    assert load_balancing_loss(
        lopsided, assignments_per_sequence(softmax_topk(lopsided, 1)[1], 2)
    ).item() == pytest.approx(1.5)
    uniform = torch.zeros(1, 4, 4)
    assert load_balancing_loss(
        uniform, assignments_per_sequence(torch.arange(4).view(1, 4, 1), 4)
    ).item() == pytest.approx(1.0)


def test_balance_loss_is_the_mean_over_sequences():
    """So a batch gives the same loss however it is split over ranks and micro-steps."""
    torch.manual_seed(0)
    logits = torch.randn(4, 16, 8)
    experts = softmax_topk(logits, 2)[1]
    per_sequence = [
        load_balancing_loss(logits[i : i + 1], assignments_per_sequence(experts[i : i + 1], 8)) for i in range(4)
    ]
    torch.testing.assert_close(
        load_balancing_loss(logits, assignments_per_sequence(experts, 8)), torch.stack(per_sequence).mean()
    )


def naive_moe(x, weights, experts, w1, w2, w3):
    """Token by token: sum over its chosen experts of weight * w2(silu(w1 x) * w3 x)."""
    rows = []
    for n in range(x.shape[0]):
        row = 0
        for slot in range(experts.shape[1]):
            e = experts[n, slot]
            row = row + weights[n, slot] * (w2[e] @ (F.silu(w1[e] @ x[n]) * (w3[e] @ x[n])))
        rows.append(row)
    return torch.stack(rows)


def moe_inputs(num_tokens=40, dim=16, hidden=24, num_experts=6, top_k=2, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(num_tokens, dim, dtype=dtype, requires_grad=True)
    w1, w3 = (torch.randn(num_experts, hidden, dim, dtype=dtype, requires_grad=True) for _ in range(2))
    w2 = torch.randn(num_experts, dim, hidden, dtype=dtype, requires_grad=True)
    logits = torch.randn(num_tokens, num_experts)
    logits[:, -1] = -100  # one expert gets no tokens: empty groups must work
    weights, experts = softmax_topk(logits, top_k)
    counts = torch.bincount(experts.flatten(), minlength=num_experts)
    return x, weights, experts, counts, w1, w2, w3


def test_expert_compute_equals_the_per_token_loop():
    x, weights, experts, counts, w1, w2, w3 = moe_inputs(dtype=torch.float64)  # exact up to summation order
    assert counts[-1] == 0
    got = experts_forward(x, weights, experts, counts, w1, w2, w3, grouped=False)
    expected = naive_moe(x, weights, experts, w1, w2, w3)
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (x, w1, w2, w3), grad)
    expected_grads = torch.autograd.grad(expected, (x, w1, w2, w3), grad)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad)


def test_grouped_gemm_path_equals_the_loop():
    """The CUDA path (torch._grouped_mm, bf16), run on the CPU where this torch has a CPU kernel."""
    x, weights, experts, counts, w1, w2, w3 = moe_inputs(dim=16, hidden=32, dtype=torch.bfloat16)
    order = experts.flatten().argsort(stable=True)
    sorted_x = x[order // 2].detach()
    try:
        grouped = _grouped_swiglu(sorted_x, counts, w1, w2, w3)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {error}")
    looped = _looped_swiglu(sorted_x, counts, w1, w2, w3)
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=2e-2, atol=2e-1)


def test_moe_module_returns_balance_loss_and_load():
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=24, num_experts=4, top_k=2)
    moe.init_weights("layers.0.feed_forward.", seed=0, out_std=0.02)
    # Stored [experts * rows, in]: FSDP's dim-0 shards stay even with more ranks than experts.
    assert moe.w1.shape == (4 * 24, 16) and moe.w2.shape == (4 * 16, 24)
    x = torch.randn(3, 10, 16)
    out, aux_loss, tokens_per_expert = moe(x)
    assert out.shape == x.shape
    assert tokens_per_expert.tolist() == torch.bincount(softmax_topk(moe.gate(x), 2)[1].flatten(), minlength=4).tolist()
    assert tokens_per_expert.sum() == 3 * 10 * 2
    logits = moe.gate(x)
    torch.testing.assert_close(
        aux_loss, load_balancing_loss(logits, assignments_per_sequence(softmax_topk(logits, 2)[1], 4))
    )


def test_mixtral_collects_aux_loss_and_router_metrics():
    torch.manual_seed(0)
    args = small_args("mixtral")
    model = materialize("mixtral", args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    _, extra = model(tokens, extra_losses=True)  # the balance loss is returned by the forward, not left on the model
    h, block_losses = model.tok_embeddings(tokens), []
    for block in model.layers.values():
        h, aux_loss, _ = block(h, model.rope_cos[:16], model.rope_sin[:16], None)
        block_losses.append(aux_loss)
    torch.testing.assert_close(extra["moe_aux"], torch.stack(block_losses).mean())
    extra["moe_aux"].backward()  # the balance loss reaches the routers
    assert model.layers["0"].feed_forward.gate.weight.grad.abs().sum() > 0
    model(tokens)
    metrics = model.extra_metrics()
    assert metrics["moe/balance_loss"].item() == pytest.approx(extra["moe_aux"].item())  # same tokens twice
    shares = torch.stack([metrics[f"moe/expert_share/{i}"] for i in range(args.num_experts)])
    assert shares.sum().item() == pytest.approx(1.0)
    assert metrics["moe/max_load"] >= 1.0
    assert model.extra_metrics() == {}  # reset by reading
    model.eval()
    model(tokens)
    assert model.extra_metrics() == {}  # evaluation is not training statistics


def test_mixtral_blocks_compile_fullgraph_under_activation_checkpointing():
    """As parallelize_decoder applies them: op-level selective AC, then compile of each block."""
    from titanlite.config_sections import ActivationCheckpoint, Compile
    from titanlite.parallel.ac import apply_ac
    from titanlite.parallel.compile import apply_compile

    args = small_args("mixtral", n_layers=1)
    reference, model = materialize("mixtral", args), materialize("mixtral", args)
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(model, Compile(enable=True, components=["model"], backend="eager"))
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    aux = {}
    for m in (reference, model):
        logits, extra = m(tokens, extra_losses=True)
        (logits.float().logsumexp(-1).mean() + extra["moe_aux"]).backward()
        aux[m] = extra["moe_aux"]
    torch.testing.assert_close(aux[model], aux[reference])
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


# --- GPT-2 ---


def test_gpt2_structure_and_init():
    args = small_args("gpt2")
    model = materialize("gpt2", args)
    assert model.output.weight is model.tok_embeddings.weight
    block = model.layers["1"]
    assert isinstance(block.attention_norm, torch.nn.LayerNorm) and block.attention_norm.bias is not None
    assert block.attention.wqkv.bias is not None and torch.equal(block.feed_forward.w2.bias, torch.zeros(args.dim))
    assert model.pos_embeddings.weight.shape == (64, args.dim)
    big = materialize("gpt2", replace(args, dim=512, n_heads=8, n_layers=8))
    assert big.layers["0"].feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers["0"].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    again = materialize("gpt2", args)
    for name, value in model.state_dict().items():
        assert torch.isfinite(value).all() and torch.equal(value, again.state_dict()[name]), name


def test_gpt2_is_causal_and_refuses_long_sequences():
    torch.manual_seed(0)
    args = small_args("gpt2")
    model = materialize("gpt2", args)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % args.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])
    with pytest.raises(UserError, match="training.seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


# --- every family under torchrun: FSDP on 2 ranks equals one process, and learns ---

SEQ_LEN, STEPS = 64, 8


def window_sized_documents(folder, count: int):
    """`count` pieces of the sample corpus, each exactly one training window (SEQ_LEN + 1 tokens
    with bos and eos), one .txt file each. Every window is then one whole document, and rank r of
    2 takes every other document of the shuffled order, so 2 ranks with 4 rows each see the same
    global batches as 1 process with 8: real text, so the loss also shows learning."""
    from titanlite.config_sections import Model
    from titanlite.data.sample_corpus import sample_documents
    from titanlite.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(Model())
    ids = tokenizer.encode("\n".join(sample_documents()[:40]), bos=False, eos=False)
    piece = SEQ_LEN - 1
    written = 0
    for start in range(0, len(ids) - piece, piece):
        text = tokenizer.decode(ids[start : start + piece])
        if len(tokenizer.encode(text, bos=True, eos=True)) == SEQ_LEN + 1:  # survives decode -> encode
            (folder / f"{written:04d}.txt").write_text(text)
            written += 1
            if written == count:
                return folder
    raise AssertionError(f"the sample corpus gave only {written} window-sized documents")


def family_run(folder, data, family, local_batch):
    return [
        *ON_CPU,
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(folder),
        "--model.name",
        family,
        "--training.dataset_path",
        str(data),
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.local_batch_size",
        str(local_batch),
        "--training.steps",
        str(STEPS),
        "--optimizer.lr",
        "3e-3",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--training.mixed_precision_param",
        "float32",
        # A strong balance loss, so a rank-dependent one would show in the losses.
        "--model.moe_aux_loss_coeff",
        "1.0",
    ]


@pytest.mark.extended
def test_fsdp_two_ranks_equal_one_process_and_learn(tmp_path):
    """Every family but Llama (tested on its own elsewhere), global batch 8: one process with 8 rows, or two
    FSDP ranks with 4 each (8 rows keep GPT-2's early steps free of spikes, which would magnify rounding
    differences). One launch per world size runs every family (tests/layout_runs.py): start-up paid once."""
    families = (*FAMILIES, "qwen3", "qwen3_moe")
    data = tmp_path / "data"
    data.mkdir()
    window_sized_documents(data, count=8 * STEPS)
    launch(
        [{"argv": family_run(tmp_path / f"{family}_one", data, family, local_batch=8)} for family in families],
        1,
        tmp_path,
        "one",
    )
    two_ranks = launch(
        [{"argv": family_run(tmp_path / f"{family}_two", data, family, local_batch=4)} for family in families],
        2,
        tmp_path,
        "two",
    )
    assert two_ranks.count("mesh dp_replicate 1 x dp_shard 2") >= len(families), two_ranks[-2000:]
    for family in families:
        single = tensorboard_scalars(tmp_path / f"{family}_one" / "tb", "loss/train")
        sharded = tensorboard_scalars(tmp_path / f"{family}_two" / "tb", "loss/train")
        assert sorted(single) == sorted(sharded) == list(range(1, STEPS + 1)), family
        for step in single:
            assert sharded[step] == pytest.approx(single[step], rel=1e-5, abs=1e-5), (family, step)
        assert sharded[STEPS] < sharded[1] - 1.0, (family, sharded)
        if family in ("mixtral", "qwen3_moe"):
            aux = tensorboard_scalars(tmp_path / f"{family}_two" / "tb", "moe/balance_loss")
            assert sorted(aux) == list(range(1, STEPS + 1)) and all(1.0 <= v < 8.0 for v in aux.values()), family
            shares = [
                tensorboard_scalars(tmp_path / f"{family}_two" / "tb", f"moe/expert_share/{i}")[STEPS] for i in range(8)
            ]
            assert sum(shares) == pytest.approx(1.0, abs=1e-4), family


# --- Hugging Face adapters ---


def hf_args(family: str):
    """Debug-sized args for name and shape checks: 1 layer, dim 64, 4 heads (2 kv), 3 experts."""
    overrides = {"vocab_size": 50, "n_layers": 1, "dim": 64, "n_heads": 4, "max_seq_len": 16}
    if family != "gpt2":
        overrides.update(n_kv_heads=2, multiple_of=32)  # FFN hidden: 2/3 * 4 * 64 = 170 -> 192
    if family == "mixtral":
        overrides.update(num_experts=3)
    return replace(get_model_args(get_model_spec(family), "debugmodel"), **overrides)


LLAMA_LAYOUT = {
    "model.embed_tokens.weight": (50, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.self_attn.v_proj.weight": (32, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (50, 64),
}
EXPECTED_HF_LAYOUT = {
    "mistral": {
        **LLAMA_LAYOUT,
        "model.layers.0.mlp.gate_proj.weight": (192, 64),
        "model.layers.0.mlp.up_proj.weight": (192, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 192),
    },
    "mixtral": {
        **LLAMA_LAYOUT,
        "model.layers.0.block_sparse_moe.gate.weight": (3, 64),
        **{
            f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": (64, 192) if w == "w2" else (192, 64)
            for e in range(3)
            for w in ("w1", "w2", "w3")
        },
    },
    "gpt2": {  # Conv1D weights are [in, out]
        "transformer.wte.weight": (50, 64),
        "transformer.wpe.weight": (16, 64),
        "transformer.h.0.ln_1.weight": (64,),
        "transformer.h.0.ln_1.bias": (64,),
        "transformer.h.0.attn.c_attn.weight": (64, 192),
        "transformer.h.0.attn.c_attn.bias": (192,),
        "transformer.h.0.attn.c_proj.weight": (64, 64),
        "transformer.h.0.attn.c_proj.bias": (64,),
        "transformer.h.0.ln_2.weight": (64,),
        "transformer.h.0.ln_2.bias": (64,),
        "transformer.h.0.mlp.c_fc.weight": (64, 256),
        "transformer.h.0.mlp.c_fc.bias": (256,),
        "transformer.h.0.mlp.c_proj.weight": (256, 64),
        "transformer.h.0.mlp.c_proj.bias": (64,),
        "transformer.ln_f.weight": (64,),
        "transformer.ln_f.bias": (64,),
    },
}


def random_state(family: str, args, seed: int = 0) -> dict[str, torch.Tensor]:
    model = get_model_spec(family).model_cls(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # norms and biases start at 1 / 0: make every tensor distinct
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_names_and_shapes_are_transformers(family):
    args = hf_args(family)
    hf = get_model_spec(family).hf_adapter.to_hf(random_state(family, args), args)
    assert {k: tuple(v.shape) for k, v in hf.items()} == EXPECTED_HF_LAYOUT[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_round_trip_through_files_is_exact(tmp_path, family):
    from titanlite.checkpoint.hf_io import HFReader, HFWriter, read_hf_tensors

    adapter, args = get_model_spec(family).hf_adapter, hf_args(family)
    state = random_state(family, args)
    back = adapter.from_hf(adapter.to_hf(state, args), args)
    assert back.keys() == state.keys()
    for name in state:
        assert torch.equal(back[name], state[name]), name
    # Through safetensors files, reading each tensor by its hf_names, as checkpoint loading does.
    writer = HFWriter(tmp_path)
    writer.add(adapter.to_hf(state, args))
    writer.finish(adapter.hf_config(args))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    read = dict(read_hf_tensors(HFReader(tmp_path), shapes, adapter, args, f"{family}/test"))
    for name in state:
        assert torch.equal(read[name], state[name]), name


def test_hf_configs():
    mistral, mixtral, gpt2 = (get_model_spec(f) for f in FAMILIES)
    config = mistral.hf_adapter.hf_config(mistral.flavors["7B"], "bfloat16")
    assert config["architectures"] == ["MistralForCausalLM"] and config["model_type"] == "mistral"
    assert {
        k: config[k] for k in ("sliding_window", "rope_theta", "vocab_size", "intermediate_size", "num_key_value_heads")
    } == {
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
    }
    assert "attention_bias" not in config
    mathstral = mistral.hf_adapter.hf_config(mistral.flavors["mathstral-7B"])
    assert mathstral["sliding_window"] is None and mathstral["rope_theta"] == 1e6 and mathstral["vocab_size"] == 32768
    config = mixtral.hf_adapter.hf_config(mixtral.flavors["8x7B"])
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 14336)
    assert config["sliding_window"] is None and config["rope_theta"] == 1e6
    config = gpt2.hf_adapter.hf_config(gpt2.flavors["124M"])
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert {
        k: config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "activation_function")
    } == {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "activation_function": "gelu_new",
    }
    assert "n_embd 1" in gpt2.hf_adapter.config_mismatch({**config, "n_embd": 1}, gpt2.flavors["124M"])


def hf_gpt2_forward(hf: dict[str, torch.Tensor], tokens: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GPT2LMHeadModel's forward written from the HF tensors: Conv1D is x @ W + b."""
    seq_len = tokens.shape[1]
    h = hf["transformer.wte.weight"][tokens] + hf["transformer.wpe.weight"][:seq_len]

    def conv1d(x, name):
        return x @ hf[f"{name}.weight"] + hf[f"{name}.bias"]

    def layer_norm(x, name):
        return F.layer_norm(x, x.shape[-1:], hf[f"{name}.weight"], hf[f"{name}.bias"], eps=1e-5)

    def heads(t):
        return t.view(*t.shape[:2], n_heads, -1).transpose(1, 2)

    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    for i in range(sum(1 for k in hf if k.endswith(".ln_1.weight"))):
        p = f"transformer.h.{i}"
        q, k, v = conv1d(layer_norm(h, f"{p}.ln_1"), f"{p}.attn.c_attn").split(h.shape[-1], dim=-1)
        q, k, v = heads(q), heads(k), heads(v)
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(future, float("-inf"))
        h = h + conv1d((scores.softmax(-1) @ v).transpose(1, 2).flatten(2), f"{p}.attn.c_proj")
        m = F.gelu(conv1d(layer_norm(h, f"{p}.ln_2"), f"{p}.mlp.c_fc"), approximate="tanh")
        h = h + conv1d(m, f"{p}.mlp.c_proj")
    return layer_norm(h, "transformer.ln_f") @ hf["transformer.wte.weight"].T


def test_gpt2_hf_tensors_compute_the_same_logits():
    """Transposes and the q/k/v order checked by computing, not just by names and shapes."""
    family, args = "gpt2", replace(hf_args("gpt2"), n_layers=2)
    state = random_state(family, args)
    model = get_model_spec(family).model_cls(args)
    model.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    hf = get_model_spec(family).hf_adapter.to_hf(state, args)
    with torch.no_grad():
        torch.testing.assert_close(hf_gpt2_forward(hf, tokens, args.n_heads), model(tokens), rtol=1e-4, atol=1e-4)


def test_mixtral_hf_experts_compute_the_same_moe():
    """Mixtral's sparse block from the per-expert HF tensors: softmax over all experts, top-2,
    renormalise, sum of w2(silu(w1 x) * w3 x)."""
    family, args = "mixtral", hf_args("mixtral")
    state = random_state(family, args)
    model = get_model_spec(family).model_cls(args)
    model.load_state_dict(state)
    hf = get_model_spec(family).hf_adapter.to_hf(state, args)
    x = torch.randn(1, 6, args.dim)
    prefix = "model.layers.0.block_sparse_moe"
    probs = (x @ hf[f"{prefix}.gate.weight"].T).softmax(-1)
    top, chosen = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    expected = torch.zeros_like(x)
    for t in range(6):
        for slot in range(2):
            e = f"{prefix}.experts.{chosen[0, t, slot]}"
            y = x[0, t]
            out = hf[f"{e}.w2.weight"] @ (F.silu(hf[f"{e}.w1.weight"] @ y) * (hf[f"{e}.w3.weight"] @ y))
            expected[0, t] += top[0, t, slot] * out
    with torch.no_grad():
        torch.testing.assert_close(model.layers["0"].feed_forward(x)[0], expected, rtol=1e-5, atol=1e-5)
