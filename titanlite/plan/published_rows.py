"""Measured and published training runs the planner is held against, each with its source.

Each row is a shipped config plus flags (the job as titanlite would run it) and what the run
measured: tps per GPU (tokens every GPU processes per second, each token counted once, as titanlite
and torchtitan both count it) and, where given, peak memory per GPU. Memory kinds differ by source:
titanlite's run summary reports torch.cuda.max_memory_allocated, torchtitan logs
max_memory_reserved (torchtitan/metrics.py at commit 9dec370; its launch script sets expandable
segments, as titanlite does), which the planner's peak plus memory.ALLOCATOR_MARGIN predicts.

The split into TUNING rows (the constants of plan/hardware.py are fitted on them, by
scripts/fit_planner.py) and held-out rows was fixed before any constant was fitted, by one rule: each
source's smallest job tunes, everything larger is held out. Tuning: titanlite's Llama 3.2 1B rows on
one H100; torchtitan's Llama 3.1 8B rows on 8 Grand Teton H100s (tt-2412 Table 1) and on 64 with TP 8
(tt-2506); its Llama 3 8B rows on 64 A100s (tt-2410). Held out: the 8B's layer shapes on one H100, the
8B on 128 GPUs, every 13B, 70B and 405B row (TP, PP, async TP, float8 at scale), all of Trainy's
H200 rows (another team and GPU; no row of theirs tunes), and the 8B's long windows of tt-2412 Table 2
(32k to 128k tokens, CP, added after the constants were fitted, none refitted), and the 1B's best
configuration measured on titanlite's second GPU run (added after the fit, none refitted). A first run with guessed
constants came
before the rule (it showed that no TP row was among the first choice of tuning rows, which had left
TP's constants unfittable); no row moved after fitting. `python -m titanlite.plan.published_table`
prints every row's prediction and error (docs/benchmarks.md holds its output).

Sources (cited per row by key):
- titanlite-h100: titanlite's one-H100 run, one H100 80GB HBM3, torch 2.11 + CUDA 13, torchao 0.17,
  synthetic tokens under causal attention, November 2026 (docs/benchmarks.md "One H100").
- titanlite-h100-1126: titanlite's second GPU run, 2026-11-26, the same kind of H100 and software
  (docs/benchmarks.md "First GPU run"): scripts/gpu_check.py's `best` run.
- tt-2412: github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit b5bcd76;
  runs of December 2024, torchtitan 9dec370): 8 H100 96GB HBM2e at 500 W per host (Grand Teton),
  NVLink, 400 Gb/s RDMA per GPU. Table 2 (the 8B with FSDP x CP on 8 GPUs, the window growing with CP) is held
  out but for its CP8 row, whose 262,144 tokens exceed the 8B's 131,072 positions (titanlite refuses it); its
  CP ran on torch's experimental context_parallel, whose collectives differ from titanlite's key/value
  all-gather (parallel/cp.py). Table 6 (the 405B with CP and PP) is left out.
- tt-2410: github.com/pytorch/torchtitan docs/performance.md at commit 1d5815c (October 2024): 405B on
  128 of the same H100s (FSDP 16 x TP 8); Llama 3 and Llama 2 with FSDP on 64 A100 80GB.
- tt-2506: github.com/pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (commit
  b5bcd76; June 2025, same Grand Teton hosts): vanilla and async TP, bf16 and float8.
- trainy-2506: github.com/pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md
  (commit b5bcd76; Trainy on WhiteFiber, June 2025): 8 H200 per host, 400 Gb/s per GPU; the run's
  AC is torchtitan's 8B config at e7c0cae (selective op).
Assumptions where a source is silent are in the row's flags and said in its note.
"""

from dataclasses import dataclass
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "train_configs"

H100 = ["--plan.gpu", "H100 SXM", "--plan.gpus_per_node", "1", "--plan.nodes", "1"]
GRAND_TETON = ["--plan.gpu", "H100 96GB 500W", "--plan.gpus_per_node", "8"]
A100 = ["--plan.gpu", "A100 80GB", "--plan.gpus_per_node", "8", "--plan.nodes", "8"]
NO_FLOAT8 = [
    "--float8.enable",
    "false",
    "--float8.enable_fsdp_float8_all_gather",
    "false",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
    "false",
]
TENSORWISE = [
    "--float8.enable",
    "--float8.recipe_name",
    "tensorwise",
    "--float8.enable_fsdp_float8_all_gather",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
]
ROWWISE = [
    "--float8.enable",
    "--float8.recipe_name",
    "rowwise",
    "--float8.enable_fsdp_float8_all_gather",
    "false",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
    "false",
]
COMPILE, EAGER = ["--compile.enable"], ["--compile.enable", "false"]
# torchtitan compiled each block and left the loss eager until April 2025 (its train.py at 9dec370 and 1d5815c:
# "compiling loss function causes CUDA errors, turning off for now"; torch.compile(loss_fn) from bbb1b616e on),
# so its runs of 2024 computed the fp32 logits and their log-softmax eagerly, whatever compile did.
EAGER_LOSS_SOURCES = ("tt-2410", "tt-2412")
NO_AC, FULL_AC = ["--activation_checkpoint.mode", "none"], ["--activation_checkpoint.mode", "full"]
OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
EVERY_2ND_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]
ASYNC_TP = ["--parallelism.enable_async_tensor_parallel"]


@dataclass(frozen=True)
class Row:
    name: str
    source: str  # a key of the module docstring's sources
    config: str  # train_configs/<config>.toml
    flags: tuple[str, ...]
    tps: float  # per GPU
    memory_gib: float | None  # peak per GPU, None where not published
    memory_kind: str  # "allocated" or "reserved"
    tuning: bool  # fitted on; False: held out
    note: str = ""


def row(name, source, config, flags, tps, memory=None, tuning=False, note=""):
    kind = "allocated" if source.startswith("titanlite-") else "reserved"
    if source in EAGER_LOSS_SOURCES:
        flags = [*flags, "--compile.components", "model"]
    return Row(name, source, config, tuple(flags), tps, memory, kind, tuning, note)


ONE_1B = ["--training.local_batch_size", "2", *H100]
LAYERS_8B = ["--model.n_layers", "8", "--training.local_batch_size", "1", *H100]
TT_8B = ["--training.local_batch_size", "2", *OP_AC]
TT_70B = [
    "--training.local_batch_size",
    "16",
    "--parallelism.tensor_parallel_degree",
    "8",
    *FULL_AC,
    *COMPILE,
    *GRAND_TETON,
    "--plan.nodes",
    "32",
]
TT_405B_3D = [
    "--training.local_batch_size",
    "32",
    "--parallelism.pipeline_parallel_microbatch_size",
    "4",
    "--parallelism.tensor_parallel_degree",
    "8",
    "--parallelism.pipeline_parallel_degree",
    "8",
    *FULL_AC,
    *COMPILE,
    *TENSORWISE,
    *ASYNC_TP,
    *GRAND_TETON,
    "--plan.nodes",
    "64",
]
TT_405B_2D = [
    "--training.local_batch_size",
    "2",
    "--parallelism.tensor_parallel_degree",
    "8",
    "--parallelism.pipeline_parallel_degree",
    "1",
    *FULL_AC,
    *COMPILE,
    *GRAND_TETON,
    "--plan.nodes",
    "16",
]
TT_8B_CP = ["--training.local_batch_size", "1", *FULL_AC, *COMPILE, *TENSORWISE, *GRAND_TETON, "--plan.nodes", "1"]
TT_8B_TP = [
    "--training.local_batch_size",
    "12",
    "--parallelism.tensor_parallel_degree",
    "8",
    *OP_AC,
    *COMPILE,
    *GRAND_TETON,
    "--plan.nodes",
    "8",
]
A100_8B = ["--training.local_batch_size", "1", *EAGER, *NO_FLOAT8, *A100]
A100_LLAMA2 = [*EAGER, *NO_FLOAT8, *A100, "--parallelism.tensor_parallel_degree", "1"]


def row_config(item: Row):
    from titanlite.config import load_config

    return load_config(["--job.config_file", str(CONFIGS / f"{item.config}.toml"), *item.flags])


def plan_row(item: Row):
    """The planner's JobPlan for the row's job."""
    from titanlite.plan.job import plan_job

    return plan_job(row_config(item))


def speed_inputs(item: Row) -> tuple:
    """job_speed's arguments for the row's job (its shards from the fake world; no activation tally)."""
    from titanlite.models import get_model_spec
    from titanlite.models.construct import meta_model
    from titanlite.parallel.dims import ParallelDims
    from titanlite.plan.job import model_args, plan_states

    cfg = row_config(item)
    spec = get_model_spec(cfg.model.name)
    world = cfg.plan.nodes * cfg.plan.gpus_per_node
    whole = meta_model(spec, model_args(cfg, spec), cfg.training.param_dtype, cfg.lora)
    return cfg, spec, whole, ParallelDims.from_config(cfg.parallelism, world), plan_states(cfg, world)


def predicted_memory_gib(item: Row, peak: int) -> float:
    """The planner's figure for what the row's source reports, from its peak allocated bytes: that peak, or
    reserved, the peak plus the allocator's margin."""
    from titanlite.plan.memory import ALLOCATOR_MARGIN, GIB

    return peak * (1 if item.memory_kind == "allocated" else 1 + ALLOCATOR_MARGIN) / GIB
