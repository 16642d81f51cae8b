"""Pipeline parallelism on CPU (gloo): every schedule, PP with FSDP and TP, checkpoints across
layouts and the refused layouts. The trainer runs of one world size share one launch
(tests/layout_runs.py), and their losses are read from TensorBoard (float32)."""

import json
import re

import pytest
from conftest import DEBUG_CONFIG, ON_CPU, assert_planned_state, run_test_script, run_titanlite, tensorboard_scalars

from titanlite.config import load_config
from titanlite.config_sections import Parallelism
from titanlite.data.prepare import prepare
from titanlite.errors import UserError
from titanlite.parallel.pp import check_pipeline, layer_split

# Constant lr after the 2 warm-up steps: runs of different lengths (a 20-step run, a resume to step
# 7) take the same lr at every step, so their losses are comparable step by step.
COMMON = [
    *ON_CPU,
    "--job.config_file",
    DEBUG_CONFIG,
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "--lr_scheduler.min_lr_factor",
    "1",
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
LAYOUTS = {  # name: (world size, flags)
    "one": (1, []),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    # Two data-parallel ranks of 2 windows: the same global batch of 4, read from a token store,
    # whose order does not depend on the data-parallel degree.
    "fsdp2": (2, ["--training.local_batch_size", "2", "--training.global_batch_size", "4"]),
}
# Saved at step 5 under the first layout, resumed under the second: one line per pair.
RESUMES = [("tp2", "pp2"), ("pp2", "tp2"), ("pp2", "one"), ("tp2", "fsdp2"), ("fsdp2", "tp2"), ("fsdp2", "pp2")]
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
SAVE_STEP, RESUME_STEPS = 5, 7


def launch(runs: list[dict], world: int, tmp_path, label: str) -> str:
    """The runs in one process group of `world` ranks; returns their log (stderr), the runs in order."""
    spec = tmp_path / f"{label}.json"
    spec.write_text(json.dumps(runs))
    out = run_test_script("layout_runs.py", str(spec), nproc=world, timeout=400)
    # The last 200 lines reach a dying rank's cause (its traceback, or faulthandler's stacks) past torchrun's summary.
    assert out.returncode == 0, "\n".join(out.stderr.splitlines()[-200:])
    return out.stderr


def run(
    tmp_path, name: str, flags: list[str], steps: int, resume_from: str | None = None, checkpoint: bool = False
) -> dict:
    """One trainer run; it reads the token store in tmp_path/store when there is one."""
    store = tmp_path / "store"
    data = ["--training.dataset_path", str(store)] if store.exists() else []
    argv = [*COMMON, *data, *flags, "--job.dump_folder", str(tmp_path / name), "--training.steps", str(steps)]
    if checkpoint or resume_from:
        argv += ["--checkpoint.enable", "--checkpoint.interval", str(SAVE_STEP)]
    return {
        "argv": argv,
        "resume_from": resume_from and str(tmp_path / resume_from / "checkpoint" / f"step-{SAVE_STEP}"),
    }


def losses(tmp_path, name: str) -> dict[int, float]:
    return tensorboard_scalars(tmp_path / name / "tb", "loss/train")


def resume_runs(tmp_path, world: int) -> list[dict]:
    """The resumes whose target layout has this world size; their sources ran in an earlier launch."""
    return [
        run(tmp_path, f"{source}_to_{target}", LAYOUTS[target][1], RESUME_STEPS, resume_from=source)
        for source, target in RESUMES
        if LAYOUTS[target][0] == world
    ]


@pytest.mark.extended
def test_every_schedule_and_resume_across_layouts_equal_one_process(tmp_path):
    """PP2 under each schedule gives the 1-process fp32 losses (within 1e-5), 1F1B learns over 20
    steps (the issue's acceptance run) and validates (forward only) to the same loss, with and without
    the chunked loss, Mixtral's
    balance loss reaches every stage's backward, GPT-2's tied embedding (a copy on each end) trains and
    resumes under 1 process as on one, and a checkpoint saved at step 5 under one layout
    resumes under another with the uninterrupted losses."""
    # Mixtral on ZBV: two stages per rank, rank 0 holding the first and the last, backward split in
    # input and weight gradients; with 2 micro-steps of gradient accumulation.
    mixtral = [
        "--model.name",
        "mixtral",
        "--training.global_batch_size",
        "8",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ]
    validated = ["--validation.enable", "--validation.freq", "10", "--validation.steps", "2"]
    gpt2 = ["--model.name", "gpt2"]  # tied embeddings: a copy on each end of the pipeline
    CHUNKS = ["--training.loss_chunk_tokens", "50"]  # windows of 64 tokens: chunks of 50 and 14
    prepare("sample", str(tmp_path / "store"))  # every run below reads it (the same windows at any dp degree)
    world2 = [
        run(tmp_path, "pp2", [*LAYOUTS["pp2"][1], *validated], 20, checkpoint=True),
        run(tmp_path, "tp2", LAYOUTS["tp2"][1], RESUME_STEPS, checkpoint=True),
        run(tmp_path, "fsdp2", LAYOUTS["fsdp2"][1], RESUME_STEPS, checkpoint=True),
        *[
            run(tmp_path, f"pp2_{s}", [*PP2, "--parallelism.pipeline_parallel_schedule", s], 5)
            for s in SCHEDULES
            if s != "1F1B"
        ],
        run(tmp_path, "mixtral_pp2", [*mixtral, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 5),
        run(tmp_path, "gpt2_pp2", [*gpt2, *LAYOUTS["pp2"][1]], SAVE_STEP, checkpoint=True),
        # The chunked loss runs in the last stage's forward: training and validation (1F1B), and GPT-2's
        # tied output on ZBV, where rank 0 holds the first and the last stage.
        run(tmp_path, "pp2_chunks", [*LAYOUTS["pp2"][1], *validated, *CHUNKS], 10),
        run(
            tmp_path,
            "gpt2_zbv_chunks",
            [*gpt2, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", *CHUNKS],
            5,
        ),
    ]
    log = launch(world2 + resume_runs(tmp_path, 2), 2, tmp_path, "world2")
    assert_planned_state(world2[0]["argv"], 2, log)  # the first run's summary: the planner's bytes of PP2 1F1B
    world1 = [
        run(tmp_path, "one", validated, 20),
        run(tmp_path, "mixtral_one", mixtral, 5),
        *resume_runs(tmp_path, 1),
        run(tmp_path, "gpt2_one", gpt2, RESUME_STEPS),
        run(tmp_path, "gpt2_pp2_to_one", gpt2, RESUME_STEPS, resume_from="gpt2_pp2"),
    ]
    launch(world1, 1, tmp_path, "world1")

    one = losses(tmp_path, "one")
    for name in ["pp2", "tp2", "fsdp2", "pp2_chunks", *[f"pp2_{s}" for s in SCHEDULES if s != "1F1B"]]:
        got = losses(tmp_path, name)
        for step in range(1, 6):
            assert got[step] == pytest.approx(one[step], abs=1e-5), (name, step)
    pp2 = losses(tmp_path, "pp2")
    assert pp2[20] < pp2[1] - 1.0, pp2
    validation = tensorboard_scalars(tmp_path / "one" / "tb", "loss/validation")
    assert sorted(validation) == [10, 20]
    for step, value in tensorboard_scalars(tmp_path / "pp2" / "tb", "loss/validation").items():
        assert value == pytest.approx(validation[step], abs=1e-5), step
    assert tensorboard_scalars(tmp_path / "pp2_chunks" / "tb", "loss/validation")[10] == pytest.approx(
        validation[10], abs=1e-5
    )
    mixtral_one, mixtral_pp2 = losses(tmp_path, "mixtral_one"), losses(tmp_path, "mixtral_pp2")
    for step in range(1, 6):
        assert mixtral_pp2[step] == pytest.approx(mixtral_one[step], abs=1e-5), step
    gpt2_one, gpt2_pp2, gpt2_resumed = (
        losses(tmp_path, "gpt2_one"),
        losses(tmp_path, "gpt2_pp2"),
        losses(tmp_path, "gpt2_pp2_to_one"),
    )
    assert sorted(gpt2_pp2) == [1, 2, 3, 4, 5] and sorted(gpt2_resumed) == [6, 7]
    for step, value in {**gpt2_pp2, **gpt2_resumed}.items():
        assert value == pytest.approx(gpt2_one[step], abs=1e-5), step
    gpt2_chunks = losses(tmp_path, "gpt2_zbv_chunks")
    assert sorted(gpt2_chunks) == [1, 2, 3, 4, 5] and "loss chunks 50 tokens" in log
    for step, value in gpt2_chunks.items():
        assert value == pytest.approx(gpt2_one[step], abs=1e-5), step
    for source, target in RESUMES:
        uninterrupted, resumed = losses(tmp_path, source), losses(tmp_path, f"{source}_to_{target}")
        assert sorted(resumed) == [6, 7], (source, target)
        for step in resumed:
            assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-5), (source, target, step)


@pytest.mark.extended
def test_pp2_x_fsdp2_pp2_x_tp2_and_fsdp2_x_tp2_on_four_ranks_equal_one_process(tmp_path):
    """Four processes, 2 data-parallel ranks with local batch 2 against one process with the same
    global batch of 4 (synthetic data splits the same windows either way)."""
    synthetic = ["--training.dataset", "synthetic"]
    half = ["--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    gpt2 = ["--model.name", "gpt2"]
    world4 = [
        # Two stages per rank, each its own FSDP root, on top of the data-parallel sharding.
        run(
            tmp_path,
            "pp2_fsdp2",
            [*synthetic, *half, *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
            3,
        ),
        run(tmp_path, "pp2_tp2", [*synthetic, *PP2, "--parallelism.tensor_parallel_degree", "2"], 3),
        run(tmp_path, "fsdp2_tp2", [*synthetic, *half, "--parallelism.tensor_parallel_degree", "2"], 3),
        # GPT-2's fused q/k/v split by heads (a replicated weight, each TP rank slicing its heads);
        # its final checkpoint must save (DCP refused the earlier strided layout).
        run(
            tmp_path,
            "gpt2_fsdp2_tp2",
            [*gpt2, *synthetic, *half, "--parallelism.tensor_parallel_degree", "2"],
            3,
            checkpoint=True,
        ),
    ]
    log = launch(world4, 4, tmp_path, "world4")
    assert_planned_state(world4[0]["argv"], 4, log)  # two FSDP-sharded stages per rank, counted by the planner
    launch(
        [run(tmp_path, "one", synthetic, 3), run(tmp_path, "gpt2_one", [*gpt2, *synthetic], 3)], 1, tmp_path, "world1"
    )
    for name, reference in [
        ("pp2_fsdp2", "one"),
        ("pp2_tp2", "one"),
        ("fsdp2_tp2", "one"),
        ("gpt2_fsdp2_tp2", "gpt2_one"),
    ]:
        got, one = losses(tmp_path, name), losses(tmp_path, reference)
        assert sorted(got) == [1, 2, 3], name
        for step in got:
            assert got[step] == pytest.approx(one[step], abs=1e-5), (name, step)
    assert (tmp_path / "gpt2_fsdp2_tp2" / "checkpoint" / "step-3").is_dir()


@pytest.mark.parametrize(
    "keys, n_layers, local_batch, message",
    [
        (
            {"pipeline_parallel_degree": 8},
            6,
            8,
            "the pipeline has 8 stages (pipeline_parallel_degree x stages per rank) but the model has only 6 layers",
        ),
        (
            {
                "pipeline_parallel_degree": 2,
                "pipeline_parallel_schedule": "Interleaved1F1B",
                "pipeline_parallel_stages_per_rank": 4,
            },
            6,
            8,
            "the pipeline has 8 stages",
        ),
        (
            {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 3},
            6,
            8,
            "pipeline_parallel_microbatch_size 3 does not divide training.local_batch_size 8",
        ),
        (
            {"pipeline_parallel_degree": 4, "pipeline_parallel_microbatch_size": 4},
            6,
            8,
            "1F1B needs at least as many microbatches as stages (4), but training.local_batch_size 8 / "
            "pipeline_parallel_microbatch_size 4 = 2",
        ),
        (
            {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "InterleavedZeroBubble"},
            6,
            5,
            "InterleavedZeroBubble runs its 5 microbatches (training.local_batch_size 5 / "
            "pipeline_parallel_microbatch_size 1) in 2 equal rounds",
        ),
        (
            {"pipeline_parallel_degree": 2, "pipeline_parallel_layers_per_stage": 2},
            6,
            8,
            "pipeline_parallel_layers_per_stage 2 x 2 stages is not the model's 6 layers",
        ),
    ],
)
def test_impossible_pipeline_layouts_are_one_sentence(keys, n_layers, local_batch, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_pipeline(Parallelism(**keys), keys["pipeline_parallel_degree"], n_layers, local_batch)


def test_schedule_and_stages_per_rank_must_agree():
    with pytest.raises(
        UserError,
        match=re.escape("ZBVZeroBubble runs exactly 2 stages per rank, not pipeline_parallel_stages_per_rank 3"),
    ):
        load_config(
            [
                *COMMON,
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_stages_per_rank",
                "3",
            ]
        )


def test_layers_spread_evenly_over_the_stages():
    assert layer_split(6, 4, -1) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert layer_split(126, 16, -1)[0] == range(0, 8) and layer_split(126, 16, -1)[-1] == range(119, 126)
    assert layer_split(8, 4, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_refused_pipeline_layout_exits_2_without_traceback(tiny_run):
    out = run_titanlite([*tiny_run, "--parallelism.pipeline_parallel_stages_per_rank", "2"])
    assert out.returncode == 2
    assert (
        "error: parallelism.pipeline_parallel_schedule 1F1B runs one stage per rank, but "
        "pipeline_parallel_stages_per_rank is 2"
    ) in out.stderr
    assert "Traceback" not in out.stderr
