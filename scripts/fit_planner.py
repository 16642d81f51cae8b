"""Fit the planner's fitted constants (titanlite/plan/hardware.py, memory.COMPILED_KEPT) on the tuning rows of
titanlite/plan/published_table.py, and only on them; print the values to write into hardware.py.

    PYTHONPATH=. python scripts/fit_planner.py

Least squares on log(predicted / measured) tps, so a row 10% fast weighs as one 10% slow. Each
constant is fitted where the tuning rows can tell it apart from the others: the eager factor from
the eager rows, the float8 casts from the float8 rows, the Grand Teton clock from its rows, TP's
wait per collective and async TP's hidden share from the TP rows, the A100's efficiency from its rows.
"""

import dataclasses

import numpy as np
from scipy.optimize import least_squares

from titanlite.plan import hardware
from titanlite.plan.job import job_speed
from titanlite.plan.published_rows import plan_row, predicted_memory_gib, row_config, speed_inputs
from titanlite.plan.published_table import ROWS

# name, starting value, bounds
CONSTANTS = [
    ("EAGER_ELEMENTWISE", 3.0, (1.0, 20.0)),
    ("FLOAT8_CAST_BYTES tensorwise", 8.0, (0.0, 200.0)),
    ("FLOAT8_CAST_BYTES rowwise", 16.0, (0.0, 400.0)),
    ("GRAND_TETON_CLOCK", 0.8, (0.3, 1.0)),
    ("TP_SYNC_S", 0.002, (0.0, 0.05)),
    ("ASYNC_TP_HIDDEN", 0.3, (0.0, 1.0)),
    ("MATMUL ampere", 0.78, (0.3, 1.0)),
]


def set_constants(values) -> None:
    for (name, _, _), value in zip(CONSTANTS, values):
        if name.startswith("FLOAT8_CAST_BYTES"):
            hardware.FLOAT8_CAST_BYTES[name.split()[1]] = value
        elif name == "MATMUL ampere":  # the A100's matmuls and attention scale together from the H100's measured shares
            hardware.ATTENTION["ampere"] = hardware.ATTENTION["hopper"] * value / hardware.MATMUL["hopper"]
            hardware.MATMUL["ampere"] = value
        elif name == "GRAND_TETON_CLOCK":
            gpu = hardware.GPUS["H100 96GB 500W"]
            hardware.GPUS[gpu.name] = dataclasses.replace(gpu, clock=value)
        else:
            setattr(hardware, name, value)


def fit_memory() -> None:
    """memory.COMPILED_KEPT on the compiled tuning rows with a measured peak: the peak, where the start of
    backward sets it, is lower + kept x (eager - lower); a reserved figure adds the allocator's margin."""
    rows = [
        (item, plan_row(item).memory)
        for item in ROWS
        if item.tuning and item.memory_gib and row_config(item).compile.enable
    ]

    def residuals(kept):
        return np.array(
            [
                np.log(predicted_memory_gib(item, low + kept[0] * (high - low)) / item.memory_gib)
                for item, memory in rows
                for low, high in [memory.peak_range]
            ]
        )

    fit = least_squares(residuals, [0.3], bounds=([0.0], [1.0]))
    print(f"COMPILED_KEPT = {fit.x[0]:.3g}")
    for (item, _), error in zip(rows, residuals(fit.x)):
        print(f"  {np.exp(error):.3f}  {item.name} (peak memory)")


def main() -> None:
    fit_memory()
    rows = [(item, speed_inputs(item)) for item in ROWS if item.tuning]

    def residuals(values):
        set_constants(values)
        return np.array([np.log(job_speed(*inputs).tps / item.tps) for item, inputs in rows])

    fit = least_squares(
        residuals,
        [start for _, start, _ in CONSTANTS],
        bounds=([low for _, _, (low, _) in CONSTANTS], [high for _, _, (_, high) in CONSTANTS]),
    )
    for (name, _, _), value in zip(CONSTANTS, fit.x):
        print(f"{name} = {value:.3g}")
    for (item, _), error in zip(rows, residuals(fit.x)):
        print(f"  {np.exp(error):.3f}  {item.name}")


if __name__ == "__main__":
    main()
