"""DeepSeek-V3: sizes and FLOPs, YaRN, multi-head latent attention and the routed experts against
transformers' DeepseekV3ForCausalLM through files both ways, bad shapes, and training under FSDP2,
TP2 and PP2 on the shipped sample."""

import dataclasses
import json

import pytest
import torch
from conftest import build_meta, materialize
from test_pipeline_parallel import launch, losses, run

from titanlite.checkpoint.fit import load_in_place, model_tensors, read_metadata
from titanlite.checkpoint.hf_io import load_model_from_hf, save_model_as_hf
from titanlite.data.prepare import prepare
from titanlite.errors import UserError
from titanlite.models import get_model_spec
from titanlite.models.deepseek_v3.args import YarnScaling
from titanlite.models.deepseek_v3.rope import rope_tables, softmax_scale
from titanlite.models.moe import SigmoidGroupMoE, sigmoid_group_topk

SPEC = get_model_spec("deepseek_v3")
ADAPTER = SPEC.hf_adapter


def small_args(**overrides):
    """Debug sizes for the comparisons with transformers: YaRN stretched past 16 positions with
    mscale != mscale_all_dim (both magnitudes matter), v_head_dim unlike the qk head, 8 experts in 4
    groups of which a token may use 2, one dense block then MoE blocks."""
    args = dataclasses.replace(
        SPEC.flavors["debugmodel"],
        vocab_size=97,
        n_layers=3,
        n_dense_layers=1,
        dim=64,
        n_heads=4,
        ffn_hidden_dim=96,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        moe_hidden_dim=24,
        num_experts=8,
        num_shared_experts=2,
        top_k=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_seq_len=64,
        norm_eps=1e-5,
        rope_scaling=YarnScaling(factor=4.0, original_max_seq_len=16, mscale=0.9, mscale_all_dim=0.7),
    )
    return dataclasses.replace(args, **overrides)


# --- sizes and FLOPs ---


def test_671b_counts_the_published_total_and_active_parameters():
    """DeepSeek-V3 without its MTP module: 671,026,404,352 trained parameters (the report's 671B), and
    with the 58 MoE blocks' 256 routing biases (buffers, in the checkpoint) 671,026,419,200 values.
    A token uses 37,552,282,624 (the report's 37B active, embedding included)."""
    model = build_meta("deepseek_v3", "671B")
    layer = 187_107_328 + 2 * 7168  # MLA (wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo) + two norms
    expert = 3 * 7168 * 2048
    dense, moe = layer + 3 * 7168 * 18432, layer + 257 * expert + 256 * 7168  # 256 routed + 1 shared, router
    assert model.num_params() == 3 * dense + 58 * moe + 2 * 129280 * 7168 + 7168 == 671_026_404_352
    assert model.num_params() + sum(b.numel() for name, b in model.named_buffers() if "bias" in name) == 671_026_419_200
    assert model.num_params(active=True) == 671_026_404_352 - 58 * 248 * expert == 37_552_282_624


def test_16b_is_moonlight_sized():
    """Moonlight-16B-A3B's config.json shapes: 15.96B parameters, 2.91B active (its "A3B")."""
    model = build_meta("deepseek_v3", "16B")
    assert model.num_params() == 15_960_108_544
    assert model.num_params(active=True) == 15_960_108_544 - 26 * 58 * 3 * 2048 * 1408 == 2_914_774_528


def test_flops_count_active_parameters_and_mla_attention():
    model = build_meta("deepseek_v3", "671B")
    active_matmuls = 37_552_282_624 - 129280 * 7168  # the embedding is a lookup; the output projection counts
    attention = 6 * 61 * 128 * (192 + 128) * 4096  # scores over nope + rope dims, weighted sums over v dims
    assert SPEC.flops_per_token(model, 4096) == 6 * active_matmuls + attention


# --- YaRN and the softmax scale, against transformers ---


def test_yarn_frequencies_and_scales_are_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for args in (SPEC.flavors["671B"], small_args()):
        args = dataclasses.replace(args, max_seq_len=300)
        config = DeepseekV3Config(**{k: v for k, v in ADAPTER.hf_config(args).items() if k != "architectures"})
        inv_freq, magnitude = ROPE_INIT_FUNCTIONS["yarn"](config)
        cos, sin = rope_tables(args)
        angles = torch.outer(torch.arange(300.0), inv_freq)
        torch.testing.assert_close(cos, angles.cos() * magnitude)
        torch.testing.assert_close(sin, angles.sin() * magnitude)
        assert softmax_scale(args) == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)
    # DeepSeek-V3: cos/sin unscaled (mscale == mscale_all_dim), softmax scale (0.1 ln 40 + 1)^2 / sqrt(192).
    assert softmax_scale(SPEC.flavors["671B"]) == pytest.approx(
        (0.1 * torch.tensor(40.0).log().item() + 1) ** 2 / 192**0.5
    )


# --- the router, against transformers' ---


def test_sigmoid_group_topk_is_transformers_router_and_not_trivial():
    """Same experts and weights as DeepseekV3TopkRouter on random logits and biases; the group limit
    and the bias each change the choice of some tokens, and the weights ignore the bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    args = small_args()
    config = transformers_model(args).config
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, args.dim, generator=generator)
    with torch.no_grad():
        router.weight.normal_(generator=generator)
        router.e_score_correction_bias.normal_(generator=generator)
    moe = SigmoidGroupMoE(args.dim, 24, 8, 3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    with torch.no_grad():
        moe.gate.weight.copy_(router.weight)
        moe.expert_bias.copy_(router.e_score_correction_bias)
        _, expected_weights, expected = router(x)
        weights, experts = moe.route(moe.gate(x))
    order, expected_order = experts.argsort(-1), expected.argsort(-1)
    assert torch.equal(experts.gather(-1, order), expected.gather(-1, expected_order))
    torch.testing.assert_close(weights.gather(-1, order), expected_weights.gather(-1, expected_order))
    logits, bias = moe.gate(x).detach(), moe.expert_bias
    ungrouped = sigmoid_group_topk(logits, 3, bias, n_group=1, topk_group=1)[1]
    unbiased = sigmoid_group_topk(logits, 3, torch.zeros(8), n_group=4, topk_group=2)[1]
    for other in (ungrouped, unbiased):
        assert (other.sort(-1).values != experts.sort(-1).values).any(-1).sum() > 20


def test_balancing_moves_the_bias_toward_the_idle_experts():
    moe = SigmoidGroupMoE(16, 8, 4, 1)
    moe.balance_experts(torch.tensor([10, 0, 3, 3]), rate=0.001)  # mean 4
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.001, 0.001, 0.001, 0.001]))


# --- Hugging Face through files, both ways, against transformers ---


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight and buffer random (norm weights around 1), the routers' weights and routing biases
    wide enough that the experts chosen differ between tokens and depend on the bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "rope" in name or "inv_freq" in name:
                continue  # RoPE tables are derived, not weights
            if tensor.dim() == 1 and "bias" not in name:
                tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=generator))
            else:
                std = 1.0 if ("gate" in name and "gate_proj" not in name) or "bias" in name else 0.15
                tensor.copy_(std * torch.randn(tensor.shape, generator=generator))
    return model.eval()


def transformers_model(args):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = {k: v for k, v in ADAPTER.hf_config(args).items() if k != "architectures"}
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config, attn_implementation="eager"))


def titanlite_model(args):
    model = SPEC.model_cls(args)
    model.init_weights(seed=0)
    return model.eval()


TOKENS = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))  # 40 positions: past YaRN's 16


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": 0, "rope_scaling": None}], ids=["low-rank-q-yarn", "direct-q"]
)
def test_transformers_checkpoint_loads_with_equal_logits(tmp_path, overrides):
    """transformers writes a random DeepseekV3ForCausalLM (save_pretrained); titanlite reads the folder
    as it loads HF weights into a model, and the logits agree within 1e-4 (fp32), routing included."""
    args = small_args(**overrides)
    theirs = randomized(transformers_model(args), seed=0)
    theirs.save_pretrained(tmp_path)
    ours = titanlite_model(args)
    load_model_from_hf(ours.state_dict(), tmp_path, ADAPTER, args, "deepseek_v3/test")
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours(TOKENS)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": 0, "rope_scaling": None}], ids=["low-rank-q-yarn", "direct-q"]
)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, overrides):
    """titanlite writes its random model as an HF folder (as checkpoint.last_save_in_hf does);
    transformers' from_pretrained reads it, every tensor used, and the logits agree within 1e-4."""
    from transformers import DeepseekV3ForCausalLM

    args = small_args(**overrides)
    ours = randomized(titanlite_model(args), seed=1)
    save_model_as_hf(ours.state_dict(), tmp_path, ADAPTER, args, torch.float32, writer_rank=True)
    theirs, info = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        expected, got = theirs.eval()(TOKENS).logits, ours(TOKENS)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["rope_interleave"], config["num_nextn_predict_layers"]) == (
        ["DeepseekV3ForCausalLM"],
        True,
        0,
    )


def test_folder_of_another_model_is_one_sentence(tmp_path):
    args = small_args()
    transformers_model(dataclasses.replace(args, routed_scaling_factor=1.0)).save_pretrained(tmp_path)
    with pytest.raises(
        UserError,
        match=f"the Hugging Face folder {tmp_path} does not fit deepseek_v3/test: "
        "its config.json has routed_scaling_factor 1.0 where this model has 2.5",
    ):
        load_model_from_hf(titanlite_model(args).state_dict(), tmp_path, ADAPTER, args, "deepseek_v3/test")


def test_blocks_compile_fullgraph_under_activation_checkpointing():
    """As parallelize_decoder applies them: op-level selective AC, then compile of each block (dense and
    MoE); losses and every gradient equal the plain model's."""
    from titanlite.config_sections import ActivationCheckpoint, Compile
    from titanlite.parallel.ac import apply_ac
    from titanlite.parallel.compile import apply_compile

    args = small_args()
    reference, model = materialize("deepseek_v3", args), materialize("deepseek_v3", args)
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(model, Compile(enable=True, components=["model"], backend="eager"))
    for m in (reference, model):
        m(TOKENS).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_float8_keeps_the_routers_and_small_matmuls_in_high_precision():
    """torchao's conversion in emulation (CPU): MLA's projections and the shared experts become
    Float8Linear where both dims are multiples of 16 (wkv_a's 16 + 8 rows are not); the routers
    (16 experts here: their scores pick the experts) and the output stay; the model still trains."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from titanlite.config_sections import Float8
    from titanlite.parallel.float8 import convert_linears

    model = materialize("deepseek_v3", small_args(num_experts=16))
    convert_linears(model, Float8(enable=True), emulate=True)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert {
        "layers.1.attention.wq_b",
        "layers.1.attention.wkv_b",
        "layers.1.attention.wo",
        "layers.1.feed_forward.shared_experts.w1",
        "layers.0.feed_forward.w1",
    } <= converted
    assert not converted & {"layers.1.feed_forward.gate", "layers.1.attention.wkv_a", "output"}
    model(TOKENS).float().logsumexp(-1).mean().backward()
    assert model.layers["1"].feed_forward.gate.weight.grad.abs().sum() > 0


# --- bad shapes: one sentence each ---


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kv_lora_rank": 0}, "the MLA ranks q_lora_rank 32 and kv_lora_rank 0 must be low ranks of dim"),
        ({"q_lora_rank": 64}, "the MLA ranks q_lora_rank 64 and kv_lora_rank 16 must be low ranks of dim"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7, qk_nope_head_dim 8 and v_head_dim 12 must be an even"),
        ({"top_k": 9}, r"top_k \(num_experts_per_tok\) 9 must be between 1 and num_experts \(n_routed_experts\) 8"),
        ({"topk_group": 5}, "topk_group 5 must be between 1 and n_group 4"),
        ({"n_group": 3}, r"n_group 3 must divide num_experts \(n_routed_experts\) 8"),
        ({"top_k": 5}, "top_k .* exceeds the 4 experts of the topk_group 2 groups"),
    ],
)
def test_inconsistent_shapes_are_one_sentence(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        small_args(**overrides)
    assert str(error.value).count(". ") == 0 and "\n" not in str(error.value)


# --- training on the shipped sample: one process, FSDP2, TP2, PP2 ---

STEPS = 20
LAYOUTS = {  # name: (world size, flags); the global batch is 4 windows of 64 tokens in every layout
    "one": (1, []),
    "fsdp2": (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "4"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]),
}


def saved_routing_biases(run_folder) -> dict[str, torch.Tensor]:
    """The routers' aux-loss-free biases in a run's last checkpoint (step-5)."""
    path = run_folder / "checkpoint" / "step-5"
    names = [name for name in model_tensors(read_metadata(path)) if name.endswith("expert_bias")]
    return load_in_place(path, {name: torch.empty(8) for name in names})


@pytest.mark.extended
def test_trains_on_the_sample_under_fsdp2_tp2_pp2_as_on_one_process(tmp_path):
    """20 steps of the debug model (one dense block, three MoE blocks, low-rank q, 8 experts in 4
    groups) in each layout: the loss falls by more than 1. FSDP2, TP2 (MLA split on heads, experts
    over the ranks) and PP2 (1F1B, a dense and an MoE block on one stage) give the 1-process fp32
    losses within 1e-5 over 10 steps, PP2 to step 20. (Later, FSDP2's and TP2's rounding flips the
    expert choice of a token near a tie, which the routing biases' sign updates then carry on.)
    The aux-loss-free biases, moved after every step from the whole global batch's counts, are
    saved with the model and equal to the bit in every layout (5-step runs); PP2's checkpoint resumes
    on one process with the uninterrupted losses."""
    prepare("sample", str(tmp_path / "store"))  # the same windows at any data-parallel degree
    deepseek = ["--model.name", "deepseek_v3", "--model.moe_aux_loss_coeff", "0.01"]
    runs = [run(tmp_path, name, [*deepseek, *flags], STEPS) for name, (_, flags) in LAYOUTS.items()]
    runs += [
        run(tmp_path, f"{name}_saved", [*deepseek, *flags], 5, checkpoint=True) for name, (_, flags) in LAYOUTS.items()
    ]
    layout_of_run = [LAYOUTS[name][0] for name in LAYOUTS] * 2
    launch([r for r, world in zip(runs, layout_of_run) if world == 2], 2, tmp_path, "world2")
    resumed = run(tmp_path, "pp2_to_one", deepseek, 7, resume_from="pp2_saved")  # PP2's step 5, on one process
    launch([r for r, world in zip(runs, layout_of_run) if world == 1] + [resumed], 1, tmp_path, "world1")
    one = losses(tmp_path, "one")
    assert sorted(one) == list(range(1, STEPS + 1)) and one[STEPS] < one[1] - 1.0, one
    for name in ("fsdp2", "tp2", "pp2"):
        got = losses(tmp_path, name)
        assert sorted(got) == sorted(one) and got[STEPS] < got[1] - 1.0, (name, got)
        for step in range(1, (STEPS if name == "pp2" else 10) + 1):
            assert got[step] == pytest.approx(one[step], abs=1e-5), (name, step)
    biases = {name: saved_routing_biases(tmp_path / f"{name}_saved") for name in LAYOUTS}
    assert len(biases["one"]) == 3 and all(b.abs().max() > 0 for b in biases["one"].values())
    for name in ("fsdp2", "tp2", "pp2"):
        assert biases[name].keys() == biases["one"].keys()
        for key, bias in biases["one"].items():
            assert torch.equal(biases[name][key], bias), (name, key)
    resumed = losses(tmp_path, "pp2_to_one")
    assert sorted(resumed) == [6, 7] and all(resumed[s] == pytest.approx(one[s], abs=1e-5) for s in resumed), resumed
