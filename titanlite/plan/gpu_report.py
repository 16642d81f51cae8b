"""scripts/gpu_check.sh's report: the `run summary:` lines of each run's log -> one JSON and a markdown table.

    python -m titanlite.plan.gpu_report OUT_DIR NAME=LOG [NAME=LOG ...]
"""

import json
import re
import sys
from pathlib import Path

FIGURES = {  # name -> pattern in the run summary lines (train.py, profiling.RunSummary)
    "tps": r"run summary: .*?tps: ([\d,]+)",
    "mfu_pct": r"run summary: .*?mfu: ([\d.]+)%",
    "peak_memory_gib": r"run summary: .*?peak_memory: ([\d.]+)GiB",
    "predicted_peak_gib": r"predicted vs measured: peak_memory ([\d.]+)GiB",
    "predicted_tps": r"predicted vs measured: .*?tps ([\d,]+) vs",
    "checkpoint_lost_s": r"training lost ([\d.]+)s",
}


def summary_figures(log: str) -> dict[str, float | None]:
    """Each figure of FIGURES found in the log (None where the run did not print it)."""
    found = {}
    for name, pattern in FIGURES.items():
        match = re.search(pattern, log)
        found[name] = float(match.group(1).replace(",", "")) if match else None
    return found


def markdown(results: dict[str, dict]) -> str:
    lines = ["| run | " + " | ".join(FIGURES) + " |", "| --- |" + " ---: |" * len(FIGURES)]
    for run, figures in results.items():
        cells = ["" if figures[name] is None else f"{figures[name]:,.2f}" for name in FIGURES]
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in item for item in argv[1:]):
        print("usage: python -m titanlite.plan.gpu_report OUT_DIR NAME=LOG [NAME=LOG ...]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    runs = dict(item.split("=", 1) for item in argv[1:])
    results = {name: summary_figures(Path(log).read_text() if Path(log).exists() else "") for name, log in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
