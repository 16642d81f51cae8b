"""Per-step cost of fault tolerance: two replica groups through torchft (quorum + gradient average + should_commit
each step), and DiLoCo (a synchronization every --sync_steps), against plain HSDP over the same two ranks (torchrun,
data_parallel_replicate_degree 2), same model, data and global batch. Not a test: it prints one line per layout from
the trainer's own `run summary:` step time.

    python scripts/ft_benchmark.py                          # debug model on the CPU, 40 steps
    python scripts/ft_benchmark.py --steps 50 --seq_len 256 --device cuda
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"run summary: .*?step: ([\d.]+)s")


def step_seconds(outputs: list[str]) -> float:
    times = [float(m.group(1)) for text in outputs for m in [STEP.search(text)] if m]
    if len(times) != len(outputs):
        sys.exit("a run printed no run summary:\n" + "\n".join(text[-2000:] for text in outputs))
    return max(times)  # the groups step together: the slower one is the step


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="a multiple of --sync_steps")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sync_steps", type=int, default=10, help="DiLoCo's row: steps between synchronizations")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft_benchmark_"))
    env = child_env()
    subprocess.run([sys.executable, "-m", "titanlite.data.prepare", "--input", "sample", "--output", str(work / "store")],
                   env=env, check=True, capture_output=True)
    common = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.device", args.device,
              "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "4",
              "--training.dataset_path", str(work / "store"), "--metrics.log_freq", "1000"]
    hsdp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "titanlite.train", *common, "--parallelism.data_parallel_replicate_degree", "2",
                           "--job.dump_folder", str(work / "hsdp")], env=env, capture_output=True, text=True)
    ft = [groups_step_seconds(common, work, "ft", []),
          groups_step_seconds(common, work, "diloco", ["--fault_tolerance.semi_sync_method", "diloco",
                                                       "--fault_tolerance.sync_steps", str(args.sync_steps)])]
    plain = step_seconds([hsdp.stdout + hsdp.stderr])
    print(f"device {args.device}, debug model seq {args.seq_len}, 2 ranks x local batch 4, {args.steps} steps")
    print(f"plain HSDP (torchrun, dp_replicate 2):       {plain:.4f} s/step")
    for label, seconds in zip(("torchft, 2 replica groups of 1 rank:", f"DiLoCo, sync every {args.sync_steps} steps:"), ft):
        print(f"{label:<45}{seconds:.4f} s/step  (+{seconds - plain:.4f} s, {100 * (seconds / plain - 1):+.1f}%)")


def groups_step_seconds(common: list[str], work: Path, name: str, extra: list[str]) -> float:
    """Two replica groups of one rank each on a lighthouse of their own; the slower group's step time."""
    env = child_env()
    port = free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "2",
                                   "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    try:
        groups = [subprocess.Popen([sys.executable, "-m", "titanlite.train", *common, "--fault_tolerance.enable", "true",
                                    "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(r),
                                    "--fault_tolerance.min_replica_size", "2", "--job.dump_folder", str(work / f"{name}{r}"),
                                    *extra],
                                   env={**env, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        return step_seconds([group.communicate()[0] for group in groups])
    finally:
        lighthouse.kill()

if __name__ == "__main__":
    main()
