"""python -m titanlite.plan --job.config_file X.toml [--section.key value ...]

Prints what one rank of the job will hold and how fast the job will run on the [plan] hardware;
exits 0 when it fits, 1 when it does not (with the cheapest change that fits), 2 on a user error.
"""

import sys
import time

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.plan.job import JobPlan, cheapest_fix, plan_job
from titanlite.plan.memory import GIB, Memory


def memory_table(role: str, m: Memory) -> str:
    rows = [
        ("params", m.params),
        ("grads", m.grads),
        ("optimizer", m.optimizer),
        ("activations", m.activations),
        ("fsdp buffers", m.buffers),
        ("peak (allocated)", m.peak),
        ("needs (+margin, context)", m.needs),
        ("GPU memory", m.capacity),
    ]
    if m.reference:  # DPO's frozen reference model
        rows.insert(1, ("reference model", m.reference))
    if m.rollout:  # GRPO's rollout: the gathered policy, the KV cache and the logits (plan/rollout.py)
        rows.insert(5, ("rollout (no grads then)", m.rollout))
    lines = [f"memory of {role} (GiB):"] + [f"  {name:<26}{value / GIB:>10.2f}" for name, value in rows]
    if m.peak_range:  # compiled: between the lower bound and the eager count (plan/memory.py)
        lines.insert(
            len(lines) - 2,
            f"  {'compiled, lower - eager':<26}{m.peak_range[0] / GIB:>10.2f} - {m.peak_range[1] / GIB:.2f}",
        )
    lines.append(f"  {'share of the GPU':<26}{100 * m.share:>9.1f}%")
    return "\n".join(lines)


def speed_table(result: JobPlan) -> str:
    s = result.speed
    parts = ", ".join(f"{name} {seconds:.3f}" for name, seconds in s.parts if seconds)
    rows = [
        ("compute per step", f"{s.compute_s:.3f} s ({parts})"),
        ("FSDP collectives", f"{s.fsdp_s:.3f} s (overlapped)"),
        ("TP collectives", f"{s.tp_s:.3f} s (exposed)"),
        ("EP all-to-alls", f"{s.ep_s:.3f} s (exposed)"),
        ("CP key/value gathers", f"{s.cp_s:.3f} s (exposed)"),
        ("PP send/recv", f"{s.pp_s:.3f} s (exposed)"),
        ("pipeline bubble", f"{100 * s.bubble:.1f}% of the step"),
        *([("rollout (GRPO)", f"{s.rollout_s:.3f} s (gather, decode, old/ref forwards)")] if s.rollout_s else []),
        ("step time", f"{s.step_s:.3f} s"),
        ("tps per GPU", f"{s.tps:,.0f}"),
        ("MFU", f"{s.mfu:.1f}%"),
        ("tokens per day", f"{s.tokens_per_day:,.3g}"),
        ("GPU-hours per 1B tokens", f"{s.gpu_hours_per_billion:,.1f}"),
    ]
    return "speed:\n" + "\n".join(f"  {name:<26}{value}" for name, value in rows)


def main(argv: list[str]) -> int:
    began = time.perf_counter()
    try:
        cfg = load_config(argv)
        result = plan_job(cfg)
        print(
            f"plan: {cfg.model.name}/{cfg.model.flavor} on {cfg.plan.nodes} x {cfg.plan.gpus_per_node} {cfg.plan.gpu} "
            f"(world {result.world_size}"
            + (f" + {cfg.rl.generator_ranks} generator ranks" if cfg.rl.generator_ranks else "")
            + f"; mesh {result.mesh})"
        )
        for role, memory in result.roles:
            print(memory_table(role, memory))
        print(speed_table(result))
        for note in result.notes:
            print(f"note: {note}")
        if result.memory.fits:
            print(
                f"verdict: fits, {100 * (1 - result.memory.share):.0f}% headroom ({time.perf_counter() - began:.1f}s "
                "to plan)"
            )
            return 0
        fix = cheapest_fix(cfg)
        advice = (
            f"the cheapest change that fits: {fix[0]} ({fix[1].memory.needs / GIB:.1f} GiB, {fix[1].speed.tps:,.0f} "
            "tps per GPU)"
            if fix
            else "no single change fits; add nodes or GPUs with more memory"
        )
        print(
            f"verdict: does not fit ({result.memory.needs / GIB:.1f} GiB needed of "
            f"{result.memory.capacity / GIB:.1f}); {advice}"
        )
        return 1
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
