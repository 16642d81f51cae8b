"""What the planner says beside its tables: when float8 pays at the job's shape, by the figures
titanlite measured on one H100 80GB HBM3 (torch 2.11, CUDA 13, torchao 0.17; November 2026;
docs/benchmarks.md "When float8 pays"), and how it counts a compiled step's memory.
"""

from titanlite.config_sections import JobConfig
from titanlite.objectives import objective_class
from titanlite.plan.hardware import Gpu
from titanlite.plan.memory import COMPILED_KEPT

# Compiled tps with float8 over compiled bf16 tps, one H100, seq 8192, by recipe and model dim
# (Llama 3.2 1B: dim 2048, batch 2; Llama 3.1 8B's layer shapes: dim 4096, batch 1).
FLOAT8_MEASURED = {
    ("tensorwise", 2048): 58_554 / 53_344,
    ("tensorwise", 4096): 34_919 / 31_744,
    ("rowwise", 2048): 51_272 / 53_344,
}


def measured_speedups(recipe: str) -> str:
    found = [f"{ratio:.2f}x at dim {dim}" for (name, dim), ratio in sorted(FLOAT8_MEASURED.items()) if name == recipe]
    return ", ".join(found) if found else "not measured"


def float8_note(cfg: JobConfig, dim: int, gpu: Gpu) -> str | None:
    """One sentence on float8 for this job, or None where the GPU has no float8 tensor cores."""
    if gpu.fp8_tflops == 0:
        return None
    float8 = cfg.float8
    if not float8.enable:
        return (
            f"float8 is off; float8 tensorwise measured {measured_speedups('tensorwise')} of compiled bf16 tps "
            f"on one H100 (--float8.enable --compile.enable)"
        )
    if not cfg.compile.enable:
        return (
            "float8 without compile.enable runs torchao's casts as separate kernels and is not expected to pay; set "
            "compile.enable"
        )
    ratio = FLOAT8_MEASURED.get((float8.recipe_name, dim))
    if ratio is not None and ratio < 1:
        return (
            f"float8 {float8.recipe_name} measured {ratio:.2f}x compiled bf16 tps at dim {dim} on one H100: slower, "
            f"not faster; tensorwise measured {measured_speedups('tensorwise')} (the speed above assumes float8 pays)"
        )
    return (
        f"float8 {float8.recipe_name} measured {measured_speedups(float8.recipe_name)} of compiled bf16 tps on one H100"
        f"{'' if ratio is not None else f'; dim {dim} was not measured'}"
    )


def compile_memory_note(cfg: JobConfig) -> str | None:
    """How the memory above counts a compiled step (plan/memory.py): a range, and a point inside it."""
    if not cfg.compile.compiles("model"):
        return None
    return (
        f"a compiled step's peak lies in the range printed: its lower end counts nothing the compiler can recompute, "
        f"its upper end is the eager count; the peak takes {COMPILED_KEPT:.0%} of the way up, fitted on measured runs "
        "(titanlite's Llama 3.2 1B, seq 8192, batch 2, one H100 80GB, November 2026: 45.8 GiB compiled, 72.8 eager)"
    )


def tp_span_note(cfg: JobConfig) -> str | None:
    tp, per_node = cfg.parallelism.tensor_parallel_degree, cfg.plan.gpus_per_node
    if tp <= per_node:
        return None
    return (
        f"parallelism.tensor_parallel_degree {tp} spans nodes of plan.gpus_per_node {per_node}: every block's TP "
        f"collectives cross the inter-node fabric (counted at its speed); keep TP within a node (at most {per_node})"
    )


def plan_notes(cfg: JobConfig, dim: int, gpu: Gpu) -> list[str]:
    notes = (
        float8_note(cfg, dim, gpu),
        compile_memory_note(cfg),
        tp_span_note(cfg),
        objective_class(cfg).plan_note(cfg),
    )
    return [note for note in notes if note]
