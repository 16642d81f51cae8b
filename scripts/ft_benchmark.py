"""The price of fault tolerance per step: two replica groups of one rank through torchft (a quorum, the gradients
averaged one collective per tensor, should_commit, every step; and DiLoCo, a synchronization every --sync_steps)
against the same two processes without torchft, whose gradients are averaged by plain gloo all-reduces (one per
tensor as torchft's groups do, and one flat all-reduce of a torch.cat copy, the way titanlite averaged before).
Same model, data shares and global batch; plain HSDP over the same two ranks (torchrun, data_parallel_replicate_degree
2, FSDP2's per-module collectives) for reference. Not a test: it prints one line per layout from the trainer's own
`run summary:` step time, which includes the quorum's wait.

    python scripts/ft_benchmark.py                          # debug model on the CPU, 30 steps
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
    parser.add_argument("--steps", type=int, default=30, help="a multiple of --sync_steps")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sync_steps", type=int, default=10, help="DiLoCo's row: steps between synchronizations")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft_benchmark_"))
    env = child_env()
    subprocess.run(
        [sys.executable, "-m", "titanlite.data.prepare", "--input", "sample", "--output", str(work / "store")],
        env=env,
        check=True,
        capture_output=True,
    )
    common = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.device",
        args.device,
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        "4",
        "--training.dataset_path",
        str(work / "store"),
        "--metrics.log_freq",
        "1000",
    ]
    hsdp = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "titanlite.train",
            *common,
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--job.dump_folder",
            str(work / "hsdp"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    rows = [
        ("plain HSDP (torchrun, dp_replicate 2, FSDP2):", step_seconds([hsdp.stdout + hsdp.stderr])),
        ("no torchft, one gloo all-reduce per tensor:", pair_step_seconds(common, work, "plain", ["tensors"])),
        ("no torchft, one flat all-reduce (torch.cat):", pair_step_seconds(common, work, "flat", ["flat"])),
        ("torchft, quorum + average + commit per step:", pair_step_seconds(common, work, "ft", [])),
        (
            f"torchft DiLoCo, sync every {args.sync_steps} steps:",
            pair_step_seconds(
                common,
                work,
                "diloco",
                ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(args.sync_steps)],
            ),
        ),
    ]
    base = rows[1][1]
    print(f"device {args.device}, debug model seq {args.seq_len}, 2 processes x local batch 4, {args.steps} steps")
    for label, seconds in rows:
        print(
            f"{label:<48}{seconds:.4f} s/step  ({seconds - base:+.4f} s, {100 * (seconds / base - 1):+.1f}% against "
            "the per-tensor all-reduce without torchft)"
        )


def pair_step_seconds(common: list[str], work: Path, name: str, mode: list[str]) -> float:
    """Two processes, each a world of one reading its half of every step's batch; the slower one's step time.
    mode ["tensors"] or ["flat"]: averaged by plain gloo (baseline_worker); otherwise torchft groups with `mode`'s flags
    on a lighthouse of their own."""
    env, port = child_env(), free_port()
    lighthouse = None
    if mode in (["tensors"], ["flat"]):
        commands = [
            [
                sys.executable,
                __file__,
                "--baseline_worker",
                str(r),
                str(port),
                mode[0],
                *common,
                "--job.dump_folder",
                str(work / f"{name}{r}"),
            ]
            for r in (0, 1)
        ]
    else:
        lighthouse = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "torchft_lighthouse"),
                "--min_replicas",
                "1",
                "--bind",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
        time.sleep(1)
        commands = [
            [
                sys.executable,
                "-m",
                "titanlite.train",
                *common,
                "--fault_tolerance.enable",
                "true",
                "--fault_tolerance.group_size",
                "2",
                "--fault_tolerance.replica_id",
                str(r),
                "--fault_tolerance.min_replica_size",
                "2",
                "--job.dump_folder",
                str(work / f"{name}{r}"),
                *mode,
            ]
            for r in (0, 1)
        ]
    # Each group's output goes to a file: read from pipes one after the other, a group whose pipe filled (torchft
    # logs every quorum) would block on its next line, miss its quorum and end the other group's run too.
    logs = [work / f"{name}{r}.log" for r in (0, 1)]
    try:
        groups = [
            subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
            for command, log in zip(commands, logs)
        ]
        for group in groups:
            group.wait()
        return step_seconds([log.read_text() for log in logs])
    finally:
        if lighthouse is not None:
            lighthouse.kill()


def baseline_worker(rank: int, port: int, mode: str, train_args: list[str]) -> int:
    """The trainer as replica group `rank` of 2 without torchft: its gradients and loss averaged with the other
    process's by plain gloo all-reduces, every step committed."""
    import torch
    import torch.distributed as dist

    import titanlite.build
    import titanlite.train
    from titanlite.fault_tolerance import Alone
    from titanlite.models.init import local_tensor

    class PlainAverage(Alone):
        group_size = 2

        def __init__(self):
            self.replica_id = rank
            self.pg = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, rank == 0), rank, 2)

        def average(self, model, loss, expert_loads=None) -> None:
            tensors = [local_tensor(param.grad) for param in model.parameters() if param.grad is not None] + [
                loss.view(1)
            ]
            if mode == "flat":
                flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
                self.pg.allreduce([flat]).wait()
                flat /= 2
                offset = 0
                for tensor in tensors:  # the flat path's second copy, back into the gradients
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
                return
            for work in [self.pg.allreduce([tensor]) for tensor in tensors]:
                work.wait()
            for tensor in tensors:
                tensor.div_(2)

    titanlite.build.replica_groups = lambda cfg: PlainAverage()  # where build_training makes the groups
    return titanlite.train.main(train_args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline_worker":
        sys.exit(baseline_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]))
    main()
