"""The planner: activation + gradient peak against real CPU steps measured by torch's profiler,
every shipped config fits its hardware, and the CLI's table, verdict and advice.
(Exact per-rank state bytes against real FSDP2/HSDP/TP2/PP2 runs: conftest.assert_planned_state, called
from tests/test_distributed.py, tests/test_tensor_parallel.py and tests/test_pipeline_parallel.py on the
runs they already make, and here for EP2 and CP2; context parallelism's activations and speed below.)"""

import time

import pytest
import torch
from conftest import DEBUG_CONFIG, ROOT, torchrun_json

from titanlite.config import load_config
from titanlite.loss import build_loss
from titanlite.models import get_model_spec
from titanlite.models.construct import meta_model, parallelizer
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.parallelize import ParallelizeSettings
from titanlite.parallel.pp import keep_stage
from titanlite.plan.__main__ import main as plan_main
from titanlite.plan.activations import activations, measure
from titanlite.plan.job import model_args, plan_job

SHIPPED = sorted((ROOT / "train_configs").glob("*.toml"))
# Their model is a Hugging Face folder (generated, downloaded): planned in tests/test_hf_folder.py with one in place.
FOLDER_CONFIGS = {"debug_finetune.toml", "llama3_8b_finetune.toml", "debug_grpo.toml", "debug_agent.toml"}


def real_model(cfg, middle_stage: bool = False):
    """The trainer's model on one CPU process (built as build.build_model does), its args and dims; or, with
    `middle_stage`, a pipeline stage of all its blocks and neither end (parallel/pp.py's keep_stage)."""
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    dims = ParallelDims(1, 1)
    model = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    if middle_stage:
        model = keep_stage(model, range(args.n_layers), first=False, last=False)
    model = parallelizer(spec, dims, ParallelizeSettings.of(cfg))(model)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model, args, dims


def profiled_peak(step, warm_up_steps: int = 0) -> int:
    """Most bytes the CPU allocator held at once above the start of step(), from the profiler's allocation events."""
    for _ in range(warm_up_steps):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def measured_fwd_bwd_peak(cfg) -> int:
    """The peak of a real forward + backward of the trainer's model and loss (compiled where cfg compiles,
    after two steps that compile)."""
    model, args, dims = real_model(cfg)
    loss_fn = build_loss(cfg.training, cfg.compile)
    tokens = torch.randint(0, args.vocab_size, (cfg.training.local_batch_size, cfg.training.seq_len))

    def step():
        with mixed_precision_context(dims, cfg.training.mixed_precision_param, "cpu"):
            logits = model(tokens)
        loss_fn(logits, tokens).backward()
        model.zero_grad(set_to_none=True)  # each step starts without gradients, as the trainer's do

    return profiled_peak(step, 2 if cfg.compile.enable else 0)


AC_MODES = [["none", "op"], ["full", "op"], ["selective", "op"], ["selective", "2"]]


@pytest.mark.parametrize(
    "model",
    [
        ["--model.flavor", "debugmodel"],
        # deeper than FULL_DEPTH_UP_TO: measured at 1-2 blocks and extrapolated
        pytest.param(["--model.n_layers", "10"], marks=pytest.mark.extended),
        pytest.param(
            ["--model.name", "gpt2", "--model.flavor", "124M", "--model.n_layers", "2", "--model.tokenizer_path", ""],
            marks=pytest.mark.extended,
        ),
        # Mixture of experts: the planner routes evenly (plan/moe.py); on one rank the experts' tensors add up to
        # the batch's N * top_k assignments however the router splits them, so the real step is comparable.
        ["--model.name", "qwen3_moe"],
        pytest.param(["--model.name", "deepseek_v3"], marks=pytest.mark.extended),
    ],
    ids=["debug", "debug-10-blocks", "gpt2-124M-2-blocks", "qwen3_moe-debug", "deepseek_v3-debug"],
)
def test_activation_peak_within_10_percent_of_a_real_cpu_step(model):
    for mode, option in AC_MODES:
        cfg = load_config(
            [
                "--job.config_file",
                DEBUG_CONFIG,
                "--training.seq_len",
                "128",
                "--training.local_batch_size",
                "2",
                *model,
                "--activation_checkpoint.mode",
                mode,
                "--activation_checkpoint.selective_ac_option",
                option,
            ]
        )
        spec = get_model_spec(cfg.model.name)
        predicted = activations(cfg, spec, model_args(cfg, spec), ParallelDims(1, 1)).peak
        measured = measured_fwd_bwd_peak(cfg)
        assert predicted == pytest.approx(measured, rel=0.10), (mode, option, predicted, measured)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_middle_pipeline_stage_peaks_within_10_percent_of_a_real_one(mode):
    """A pipeline stage without the embedding and the loss (hidden states in, a gradient for its output back)
    holds, at its backward's peak, one block's recompute above what it saves under full AC: the planner tallies
    such a stage apart (activations.middle_stage_transient: every stage but the last holds that, not the
    loss's), within 10% of the real stage's peak from the CPU profiler."""
    cfg = load_config(
        [
            "--job.config_file",
            DEBUG_CONFIG,
            "--training.seq_len",
            "128",
            "--training.local_batch_size",
            "2",
            "--activation_checkpoint.mode",
            mode,
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    model, args, _ = real_model(cfg, middle_stage=True)
    hidden = torch.randn(2, 128, args.dim, requires_grad=True)

    def step():
        out = model(hidden)
        out.backward(torch.ones_like(out))

    predicted = measure(cfg, get_model_spec(cfg.model.name), args, ParallelDims(1, 1), args.n_layers, middle=True)
    assert predicted.peak == pytest.approx(profiled_peak(step), rel=0.10), (mode, predicted)


@pytest.mark.extended
def test_tensor_parallel_activations_within_10_percent_of_a_real_tp2_step(tmp_path):
    """The planner tallies an unsplit step and divides it by tp, but for what sequence parallelism holds whole on
    every rank (each block's gathered inputs, its partial sums before their reduce-scatter, their gradients, the
    output projection's gathered input). A real TP2 step on 2 gloo ranks, counted on its local shards by the same
    LiveBytes (tests/tp_activation_run.py), holds 177 / 95 / 46 MB without / with op-level / with full AC, where the
    planner says 183 / 86 / 43 (dividing everything by tp it said 170 / 78 / 40: -17% with op-level AC)."""
    flags = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.seq_len",
        "512",
        "--training.local_batch_size",
        "4",
        "--compile.enable",
        "false",
        "--training.mixed_precision_param",
        "float32",
    ]
    real = torchrun_json("tp_activation_run.py", tmp_path, *flags)
    assert set(real) == {"none", "selective", "full"}
    for mode, measured in real.items():
        cfg = load_config(
            [*flags, "--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", "op"]
        )
        spec = get_model_spec(cfg.model.name)
        predicted = activations(cfg, spec, model_args(cfg, spec), ParallelDims.from_config(cfg.parallelism, 2)).peak
        assert predicted == pytest.approx(measured, rel=0.10), (mode, predicted, measured)


@pytest.mark.extended
def test_a_compiled_cpu_step_peaks_between_the_planners_two_counts():
    """Inductor on the CPU runs the same min-cut partitioner as on a GPU: the peak of a real compiled step
    (blocks and loss compiled) lies between the planner's lower bound and its eager count, without AC and
    with op-level AC (at seq 256 x 4 it sat 0.63 of the way up in both; memory.COMPILED_KEPT puts 0.33)."""
    for mode in ("none", "selective"):
        cfg = load_config(
            [
                "--job.config_file",
                DEBUG_CONFIG,
                "--training.seq_len",
                "128",
                "--training.local_batch_size",
                "2",
                "--activation_checkpoint.mode",
                mode,
                "--activation_checkpoint.selective_ac_option",
                "op",
                "--compile.enable",
            ]
        )
        spec = get_model_spec(cfg.model.name)
        args, dims = model_args(cfg, spec), ParallelDims(1, 1)
        lower, eager = (activations(cfg, spec, args, dims, compiled).peak for compiled in (True, False))
        measured = measured_fwd_bwd_peak(cfg)
        assert lower < measured < 1.05 * eager, (
            mode,
            lower,
            measured,
            eager,
        )  # the eager count is itself within 10% (above)


# Plans of more than ~10 s on 2 cores (128-expert blocks, 28+ layer tallies): the extended tier.
SLOW_PLANS = {"qwen3_30b_a3b", "llama3_3b", "llama3_405b", "deepseek_v3_16b", "mixtral_8x7b", "llama3_70b"}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(path, marks=pytest.mark.extended if path.stem in SLOW_PLANS else ())
        for path in SHIPPED
        if path.name not in FOLDER_CONFIGS
    ],
    ids=lambda path: path.stem,
)
def test_every_shipped_config_fits_its_hardware_with_10_percent_headroom(config):
    text = config.read_text()
    assert text.startswith("# Hardware: ") and "\n[plan]\n" in text  # names its hardware, in words and in [plan]
    result = plan_job(load_config(["--job.config_file", str(config)]))
    assert result.memory.share <= 0.90, (config.name, result.memory)


def test_405b_table_in_seconds_and_advice_when_it_does_not_fit(capsys):
    began = time.perf_counter()
    config = str(ROOT / "train_configs" / "llama3_405b.toml")
    assert plan_main(["--job.config_file", config]) == 0
    assert time.perf_counter() - began < 30
    out = capsys.readouterr().out
    assert (
        "verdict: fits" in out
        and "world 256" in out
        and "tp 8, pp 8" in out
        and "pipeline bubble" in out
        and "MFU" in out
    )
    assert "compiled, lower - eager" in out and "note: a compiled step's peak lies in the range printed" in out
    # 8B at seq 8192, eager, without AC keeps ~70 GiB of activations: over an H100; the advice is one change that fits.
    assert (
        plan_main(
            [
                "--job.config_file",
                str(ROOT / "train_configs" / "llama3_8b.toml"),
                "--activation_checkpoint.mode",
                "none",
                "--compile.enable",
                "false",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out and "the cheapest change that fits: --" in out, out
    assert "compiled, lower - eager" not in out and "compiled step" not in out  # eager: one count
    assert "note: float8 without compile.enable" in out


PUBLISHED_FLOAT8_TP = [  # torchtitan's 2D and 3D float8 jobs (docs/benchmarks.md compares them with the published runs)
    ("llama3_70b.toml", ["--plan.nodes", "32", "--training.local_batch_size", "16"], "dp_shard 32 x tp 8, pp 1", 1),
    ("llama3_405b.toml", ["--plan.nodes", "64"], "dp_shard 8 x tp 8, pp 8", 2),
]


@pytest.mark.extended
@pytest.mark.parametrize("config, flags, mesh, tables", PUBLISHED_FLOAT8_TP)
def test_float8_with_tp_is_planned_like_any_layout(capsys, config, flags, mesh, tables):
    """70B FSDP x TP8 float8 on 256 H100s and 405B FSDP x TP8 x PP8 on 512: the trainer runs float8 with
    TP (torchao's float8 TP styles), so the plan gives tps and peak memory with no refusal note."""
    float8 = [
        "--activation_checkpoint.mode",
        "full",
        "--float8.enable",
        "--float8.enable_fsdp_float8_all_gather",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
    ]
    assert plan_main(["--job.config_file", str(ROOT / "train_configs" / config), *flags, *float8]) == 0
    out = capsys.readouterr().out
    assert mesh in out and "verdict: fits" in out and "refuses" not in out, out
    assert (
        out.count("peak (allocated)") == tables and float(out.split("tps per GPU")[1].split()[0].replace(",", "")) > 0
    )


def test_pipeline_plan_shows_first_and_last_stage_with_each_schedules_bubble(capsys):
    """PP2 of the debug model, 4 microbatches: one memory table per role (the first stage with the
    embedding, the last with the output and loss), the bubble of each schedule, GPipe holding all its
    microbatches' activations where 1F1B's first stage holds 2, and the activations sent between stages."""
    pp2 = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--plan.gpus_per_node",
        "2",
    ]
    assert plan_main(pp2) == 0
    out = capsys.readouterr().out
    assert (
        "memory of pp rank 0 (stage 0; embedding) (GiB):" in out
        and "memory of pp rank 1 (stage 1; output + loss) (GiB):" in out
    )
    assert "pipeline bubble           20.0% of the step" in out  # (pp - 1) / (microbatches + pp - 1) = 1 / 5
    plans = {
        schedule: plan_job(load_config([*pp2, "--parallelism.pipeline_parallel_schedule", schedule]))
        for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
    }
    bubbles = {schedule: round(plan.speed.bubble, 4) for schedule, plan in plans.items()}
    # Interleaved: (pp - 1) / v = 0.5 stage-times of warm-up beside 4 microbatches: 0.5 / 4.5
    assert bubbles == {"GPipe": 0.2, "1F1B": 0.2, "Interleaved1F1B": 0.1111, "ZBVZeroBubble": round(0.5 / 4.5 / 3, 4)}
    first_stage = {schedule: plan.roles[0][1].activations for schedule, plan in plans.items()}
    assert first_stage["GPipe"] > 1.5 * first_stage["1F1B"]
    assert [name for name, _ in plans["ZBVZeroBubble"].roles] == [
        "pp rank 0 (stages 0, 3; embedding; output + loss)",
        "pp rank 1 (stages 1, 2)",
    ]
    assert (
        plans["1F1B"].speed.pp_s > 0
        and plan_job(load_config([*pp2, "--parallelism.pipeline_parallel_degree", "1"])).speed.pp_s == 0
    )


def test_float8_note_says_when_float8_pays_by_the_measured_figures():
    """Issue 17, defect 7: rowwise at dim 2048 is slower than bf16; tensorwise pays where measured."""
    from titanlite.plan.hardware import GPUS
    from titanlite.plan.notes import float8_note

    def note(*flags, dim=2048, gpu="H100 SXM"):
        cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"), *flags])
        return float8_note(cfg, dim, GPUS[gpu])

    assert note("--float8.recipe_name", "rowwise").startswith(
        "float8 rowwise measured 0.96x compiled bf16 tps at dim 2048 on one H100: slower"
    )
    assert note() == "float8 tensorwise measured 1.10x at dim 2048, 1.10x at dim 4096 of compiled bf16 tps on one H100"
    assert note(dim=8192).endswith("; dim 8192 was not measured")
    assert note("--compile.enable", "false").startswith("float8 without compile.enable")
    off = [
        "--float8.enable",
        "false",
        "--float8.enable_fsdp_float8_all_gather",
        "false",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
        "false",
    ]
    assert note(*off).startswith("float8 is off; float8 tensorwise measured 1.10x at dim 2048")
    assert note(*off, gpu="A100 80GB") is None  # no float8 tensor cores


# Held-out rows the planner misses by more than 15%, each held to its present error so that the table in
# docs/benchmarks.md (which says why each misses) stays true: (row, "tps" or "memory") -> the error allowed.
HELD_OUT_MISSES = {
    ("Llama 2 70B, 64 A100, FSDP, bs 1, op AC", "tps"): 0.21,
    ("70B, 256 H100, FSDP 32 x TP 8, float8", "memory"): 0.28,
    ("70B, 256 H100, FSDP 32 x TP 8, float8, async TP", "memory"): 0.23,
    ("8B, 8 H100, FSDP 2 x CP 4, seq 131072, compile, float8, full AC", "tps"): 0.25,
}


@pytest.mark.extended
def test_planner_within_15_percent_of_the_held_out_published_rows():
    """The planner's tps and peak memory for every row of plan/published_table.py it was not fitted on, against
    what the run measured: within 15%, or within the error HELD_OUT_MISSES records for it."""
    from titanlite.plan.job import job_speed
    from titanlite.plan.published_rows import plan_row, predicted_memory_gib, speed_inputs
    from titanlite.plan.published_table import ROWS

    held_out = [item for item in ROWS if not item.tuning]
    assert len(held_out) == 30 and {name for name, _ in HELD_OUT_MISSES} <= {item.name for item in held_out}
    for item in held_out:
        errors = {"tps": job_speed(*speed_inputs(item)).tps / item.tps - 1}
        if item.memory_gib:  # the activation tally only where a peak was published
            errors["memory"] = predicted_memory_gib(item, plan_row(item).memory.peak) / item.memory_gib - 1
        for kind, error in errors.items():
            assert abs(error) <= HELD_OUT_MISSES.get((item.name, kind), 0.15), (item.name, kind, f"{error:+.1%}")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_plan_gathers_a_ranks_experts_and_adds_the_all_to_alls(family):
    """EP8 against EP1 on 8 GPUs of one node: every rank holds 1/8 of every weight either way (the fake world's
    own shards: E/8 whole experts on the ep mesh, or 1/8 of each expert stack by FSDP), FSDP gathers only a
    rank's E/8 experts of each block (buffers smaller by 7/8 of the largest block's experts, in the compute dtype
    twice, the block in use and the next, and once in the reduce dtype; DeepSeek's largest is then a dense block), and
    the step gains EP's all-to-alls while FSDP's
    traffic shrinks."""
    from titanlite.dtypes import DTYPES
    from titanlite.models.init import local_tensor
    from titanlite.plan.fake_world import fake_world, sharded_model
    from titanlite.plan.moe import expert_params, moe_modules

    base = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--model.name",
        family,
        "--compile.enable",
        "false",
        "--training.seq_len",
        "64",
        "--plan.gpus_per_node",
        "8",
        "--plan.nodes",
        "1",
        "--training.mixed_precision_param",
        "bfloat16",
    ]
    plans, meshes = {}, {}
    for ep in (1, 8):
        cfg = load_config([*base, "--parallelism.expert_parallel_degree", str(ep)])
        plans[ep] = plan_job(cfg)
        spec = get_model_spec(family)
        dims = ParallelDims.from_config(cfg.parallelism, 8)
        with fake_world(8):
            dims.build_mesh("cpu")
            model = sharded_model(cfg, spec, model_args(cfg, spec), dims)
            w1 = [moe.w1 for moe in moe_modules(model)]
            meshes[ep] = {w.device_mesh.mesh_dim_names for w in w1}
            assert all(local_tensor(w).numel() * 8 == w.numel() for w in w1)  # 1/8 of each stack on every rank
    assert meshes == {1: {("dp_shard",)}, 8: {("efsdp", "ep")}}  # EP8 of 8: FSDP over the efsdp ranks of 1
    one, eight = plans[1].memory, plans[8].memory
    assert (one.params, one.grads, one.optimizer) == (eight.params, eight.grads, eight.optimizer)
    whole = meta_model(spec, model_args(cfg, spec), "float32", cfg.lora)
    sizes = [(sum(p.numel() for p in block.parameters()), expert_params(block)) for block in whole.layers.values()]
    gathered = {
        ep: max(total - experts * (ep - 1) / ep for total, experts in sizes) for ep in (1, 8)
    }  # DeepSeek: a dense block at EP8
    compute, reduce = (
        DTYPES[cfg.training.mixed_precision_param].itemsize,
        DTYPES[cfg.training.mixed_precision_reduce].itemsize,
    )
    assert one.buffers - eight.buffers == pytest.approx((gathered[1] - gathered[8]) * (2 * compute + reduce), abs=16)
    assert plans[1].speed.ep_s == 0 < plans[8].speed.ep_s and plans[8].speed.fsdp_s < plans[1].speed.fsdp_s


def test_planned_state_of_an_ep2_run_equals_the_trainers(tmp_path):
    """The planner's per-rank parameter, gradient and optimizer bytes under EP2 (2 ranks: 4 of the debug model's 8
    experts each) equal, byte for byte, what a real 2-process CPU run reports in its summary."""
    from conftest import assert_planned_state, run_titanlite

    flags = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--model.name",
        "qwen3_moe",
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.steps",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
    ]
    out = run_titanlite(flags, nproc=2)
    assert out.returncode == 0, out.stderr
    assert_planned_state(flags, 2, out.stderr)


def test_planned_state_of_a_cp2_run_equals_the_trainers(tmp_path):
    """Under CP2 FSDP shards every weight over the flattened (dp_shard 1, cp 2): the planner's per-rank parameter,
    gradient and optimizer bytes equal, byte for byte, a real 2-process CPU run's, and those of FSDP over 2
    data-parallel ranks."""
    from conftest import assert_planned_state, run_titanlite

    from titanlite.plan.job import plan_state

    flags = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.steps",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
    ]
    out = run_titanlite(flags, nproc=2)
    assert out.returncode == 0, out.stderr
    assert_planned_state(flags, 2, out.stderr)
    data_parallel = [*flags[:-2], "--parallelism.context_parallel_degree", "1"]
    assert plan_state(load_config(flags), 2) == plan_state(load_config(data_parallel), 2)


def test_context_parallel_activations_are_the_ranks_share_plus_the_whole_windows_keys_and_values():
    """On 4 ranks, CP N (FSDP over dp_shard 4/N x cp N) against FSDP over 4 data-parallel ranks: a rank's activations
    are 1/N of the data-parallel rank's, except attention's keys and values. Without AC every block saves the whole
    window's (gathered, then repeated to every query head for SDPA: [B, heads, T, head_dim] each, as without CP), so
    the saved bytes exceed 1/N by layers x those x (1 - 1/N); under full AC a rank saves 1/N of the block inputs, and
    its peak, in a recomputed block's backward, holds the whole window's keys and values (and their gradients)."""
    from titanlite.dtypes import DTYPES

    plans = {}
    for mode in ("none", "full"):
        for cp in (1, 2, 4):
            cfg = load_config(
                [
                    "--job.config_file",
                    DEBUG_CONFIG,
                    "--training.seq_len",
                    "256",
                    "--training.local_batch_size",
                    "2",
                    "--activation_checkpoint.mode",
                    mode,
                    "--parallelism.context_parallel_degree",
                    str(cp),
                ]
            )
            spec = get_model_spec(cfg.model.name)
            args = model_args(cfg, spec)
            plans[mode, cp] = activations(cfg, spec, args, ParallelDims.from_config(cfg.parallelism, 4))
    layer_kv = (
        2
        * cfg.training.local_batch_size
        * args.n_heads
        * 256
        * args.head_dim
        * DTYPES[cfg.training.mixed_precision_param].itemsize
    )
    for n in (2, 4):
        no_ac, full = plans["none", n], plans["full", n]
        assert no_ac.saved - plans["none", 1].saved / n == pytest.approx(
            args.n_layers * layer_kv * (1 - 1 / n), abs=16384
        )
        assert full.saved == pytest.approx(plans["full", 1].saved / n, abs=16384)
        assert full.peak - plans["full", 1].peak / n > 2 * layer_kv * (1 - 1 / n)


def test_context_parallel_speed_divides_the_tokens_and_adds_exposed_key_value_gathers():
    """CP8 against FSDP over 8 data-parallel ranks of one node, full AC: each GPU computes 1/8 of the tokens (each
    attending to the whole window either way), FSDP moves the same bytes (8 shards either way), and the step adds,
    exposed, per layer the all-gathers of keys and values (forward and AC's recompute) and the reduce-scatters of
    their gradients (backward), each moving 7/8 of the window's keys and values over NVLink."""
    from titanlite.dtypes import DTYPES
    from titanlite.plan.hardware import COLLECTIVE_EFFICIENCY, GPUS

    base = [
        "--job.config_file",
        DEBUG_CONFIG,
        "--training.seq_len",
        "1024",
        "--activation_checkpoint.mode",
        "full",
        "--compile.enable",
        "false",
        "--plan.gpus_per_node",
        "8",
        "--plan.nodes",
        "1",
    ]
    dp = plan_job(load_config(base))
    cfg = load_config([*base, "--parallelism.context_parallel_degree", "8"])
    cp = plan_job(cfg)
    assert cp.mesh == "dp_replicate 1 x dp_shard 1 x cp 8 x tp 1, pp 1" and cp.world_size == 8
    dp_parts, cp_parts = dict(dp.speed.parts), dict(cp.speed.parts)
    for kind in ("matmuls", "attention", "elementwise"):
        assert cp_parts[kind] == pytest.approx(dp_parts[kind] / 8)
    assert cp.speed.fsdp_s == pytest.approx(dp.speed.fsdp_s) and dp.speed.cp_s == 0
    args = model_args(cfg, get_model_spec(cfg.model.name))
    window_kv = (
        cfg.training.local_batch_size
        * 1024
        * 2
        * args.n_kv_heads
        * args.head_dim
        * DTYPES[cfg.training.mixed_precision_param].itemsize
    )
    gbps = GPUS[cfg.plan.gpu].link_gbps * 1e9 * COLLECTIVE_EFFICIENCY
    assert cp.speed.cp_s == pytest.approx(3 * args.n_layers * window_kv * 7 / 8 / gbps)
    assert cp.speed.step_s == pytest.approx(cp.speed.compute_s + cp.speed.cp_s)  # FSDP hidden in both passes


@pytest.mark.extended
def test_a_window_too_long_for_one_rank_is_advised_more_context_parallel_ranks(capsys):
    """The 8B at 32,768 tokens, bf16, on 8 H100s (FSDP 8, op AC) needs 109 GiB; the advice is CP2 with the global
    batch kept (8 sequences: 4 data-parallel ranks, 2 micro-steps). A changed config skips load_config, so plan_job
    itself refuses a window that does not cut into 2 x cp chunks, which makes that change no fix."""
    import dataclasses

    from titanlite.errors import UserError

    flags = [
        "--job.config_file",
        str(ROOT / "train_configs" / "llama3_8b.toml"),
        "--training.seq_len",
        "32768",
        "--float8.enable",
        "false",
        "--float8.enable_fsdp_float8_all_gather",
        "false",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
        "false",
    ]
    assert plan_main(flags) == 1
    out = capsys.readouterr().out
    assert (
        "the cheapest change that fits: --parallelism.context_parallel_degree 2 --training.global_batch_size 8 (" in out
    ), out
    cfg = load_config(flags)
    uneven = dataclasses.replace(
        cfg,
        training=dataclasses.replace(cfg.training, seq_len=32760),
        parallelism=dataclasses.replace(cfg.parallelism, context_parallel_degree=8),
    )
    with pytest.raises(UserError, match="does not split into 2 x parallelism.context_parallel_degree 8"):
        plan_job(uneven)


@pytest.mark.extended
def test_a_tp_group_wider_than_a_node_is_said_and_counted_at_the_fabric_speed():
    """Issue 42: TP 8 with 4 GPUs per node was planned as if inside one node, with no word."""
    from titanlite.plan.hardware import GPUS
    from titanlite.plan.notes import plan_notes

    base = [
        "--job.config_file",
        str(ROOT / "train_configs" / "llama3_8b.toml"),
        "--parallelism.tensor_parallel_degree",
        "8",
        "--plan.nodes",
        "2",
    ]
    inside, across = (load_config([*base, "--plan.gpus_per_node", str(n)]) for n in (8, 4))
    assert not any("spans nodes" in note for note in plan_notes(inside, 4096, GPUS[inside.plan.gpu]))
    assert any(
        note.startswith("parallelism.tensor_parallel_degree 8 spans nodes of plan.gpus_per_node 4")
        for note in plan_notes(across, 4096, GPUS[across.plan.gpu])
    )
    assert plan_job(across).speed.tp_s > plan_job(inside).speed.tp_s
