"""Launch infrastructure: the Kubernetes manifest renderer, the Slurm batch script, run_train.sh.

Everything here runs the real scripts. The Slurm end-to-end test starts a private one-node Slurm
cluster as root and trains through multinode_trainer.slurm; it runs only with TITANLITE_SLURM_TEST=1.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPT = REPO / "multinode_trainer.slurm"
RENDER = REPO / "scripts" / "kubernetes" / "render.sh"
SHELL_SCRIPTS = [
    SLURM_SCRIPT,
    REPO / "scripts" / "run_train.sh",
    REPO / "scripts" / "slurm_local_test.sh",
    RENDER,
]

SAMPLE = {
    "JOB_NAME": "llama3-8b",
    "NUM_NODES": "4",
    "GPU_PER_NODE": "8",
    "EFA_PER_NODE": "32",
    "MAX_RESTARTS": "3",
    "IMAGE_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/titanlite:v1",
    "CONFIG_FILE": "train_configs/llama3_8b.toml",
    "DUMP_FOLDER": "/checkpoints/llama3-8b",
    "CHECKPOINT_PVC": "fsx-claim",
}


def render(env_vars: dict[str, str]) -> subprocess.CompletedProcess:
    if shutil.which("envsubst") is None:
        pytest.skip(
            "render.sh needs envsubst, which is missing here: install gettext-base (apt-get install gettext-base)"
        )
    env = {k: v for k, v in os.environ.items() if k not in SAMPLE}
    env.update(env_vars, PYTHON=sys.executable)  # the planner's check runs in this interpreter
    # The planner runs inside (seconds alone; a minute on 2 busy cores).
    return subprocess.run([str(RENDER)], env=env, capture_output=True, text=True, timeout=180)


def test_render_fills_the_pytorchjob():
    out = render(SAMPLE)
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)

    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"] == "llama3-8b"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic == {
        "rdzvBackend": "c10d",
        "minReplicas": 4,
        "maxReplicas": 4,
        "maxRestarts": 3,
        "nProcPerNode": 8,
    }
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert container["image"] == SAMPLE["IMAGE_URI"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}

    cmd = container["command"]
    assert all(isinstance(part, str) for part in cmd), cmd
    assert cmd[0] == "torchrun"
    assert cmd[cmd.index("--nproc_per_node") + 1] == "8"
    assert cmd[cmd.index("-m") + 1] == "titanlite.train"
    assert cmd[cmd.index("--job.config_file") + 1] == SAMPLE["CONFIG_FILE"]
    assert cmd[cmd.index("--job.dump_folder") + 1] == SAMPLE["DUMP_FOLDER"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory"}
    assert mounts["shm"] == "/dev/shm"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    assert mounts["checkpoints"] == SAMPLE["DUMP_FOLDER"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "HF_TOKEN" in env
    # elasticPolicy restarts need the rendezvous store unshared (see titanlite/parallel/dist.py).
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "${" not in out.stdout


def test_render_refuses_a_job_the_planner_says_does_not_fit():
    out = render({**SAMPLE, "CONFIG_FILE": "train_configs/llama3_405b.toml", "NUM_NODES": "1"})
    assert out.returncode == 1 and out.stdout == ""
    assert (
        "render.sh: not rendered: python -m titanlite.plan says train_configs/llama3_405b.toml does not fit 1 node(s) "
        "x 8 GPUs" in out.stderr
    )
    assert (
        render(
            {**SAMPLE, "CONFIG_FILE": "train_configs/llama3_405b.toml", "NUM_NODES": "1", "TITANLITE_SKIP_PLAN": "1"}
        ).returncode
        == 0
    )


def test_render_names_a_missing_variable():
    env = {k: v for k, v in SAMPLE.items() if k != "IMAGE_URI"}
    out = render(env)
    assert out.returncode != 0
    assert out.stdout == ""
    assert "IMAGE_URI" in out.stderr
    assert "NUM_NODES" not in out.stderr


def test_render_rejects_a_non_numeric_count():
    out = render({**SAMPLE, "NUM_NODES": "four"})
    assert out.returncode != 0
    assert "NUM_NODES=four" in out.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)
    assert os.access(script, os.X_OK), f"{script} is not executable"


def sbatch_options() -> dict[str, str]:
    options = {}
    for line in SLURM_SCRIPT.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH ") :].strip().partition("=")
            options[key] = value
    return options


def test_slurm_script_requests_one_torchrun_per_node_and_a_warning_signal():
    options = sbatch_options()
    assert options["--ntasks-per-node"] == "1"
    for key in ("--job-name", "--nodes", "--gpus-per-task", "--cpus-per-task", "--output"):
        assert options.get(key), key
    assert options["--signal"] == "USR1@120"  # to the job steps, not B: (the batch shell)
    text = SLURM_SCRIPT.read_text()
    # The trainer must see SIGUSR1: torchrun forwards only the signals it is told to handle.
    assert re.search(r"--signals_to_handle \S*SIGUSR1", text)
    assert '-m titanlite.train --job.config_file "$CONFIG_FILE" "$@"' in text
    # MAX_RESTARTS reaches torchrun, with the rendezvous store unshared so that restarts work.
    assert '--max-restarts "${MAX_RESTARTS:-0}"' in text
    assert re.search(r"^export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1$", text, re.M)


def nproc_per_node(**env: str) -> subprocess.CompletedProcess:
    """Run the batch script's own nproc_per_node function with this environment."""
    text = SLURM_SCRIPT.read_text()
    function = re.search(r"^nproc_per_node\(\) \{.*?^\}$", text, re.M | re.S).group(0)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "NPROC_PER_NODE"}
    return subprocess.run(
        ["bash", "-c", function + "\nnproc_per_node"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=10,
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "8"),
        ({"SLURM_GPUS_ON_NODE": "4"}, "4"),
        ({"SLURM_GPUS_PER_TASK": "h100:2"}, "2"),
        ({"SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_TASK": "0"}, "8"),
        ({"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}, "2"),
    ],
)
def test_slurm_workers_per_node(env, expected):
    out = nproc_per_node(**env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_slurm_rejects_a_bad_nproc_per_node():
    out = nproc_per_node(NPROC_PER_NODE="eight")
    assert out.returncode != 0
    assert "NPROC_PER_NODE=eight" in out.stderr


def test_run_train_launches_the_trainer_from_any_directory(tmp_path):
    """run_train.sh -> torchrun -> the real trainer, with the arguments forwarded (one cheap launch)."""
    env = {**os.environ, "NGPU": "1"}
    out = subprocess.run(
        [str(REPO / "scripts" / "run_train.sh"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "usage: python -m titanlite.train" in out.stdout


# It installs Slurm and starts its daemons as root, so it runs only when asked (TITANLITE_SLURM_TEST=1)
# or in CI (CI=true, as root), never by surprise on a user's machine.
RUN_SLURM = os.environ.get("TITANLITE_SLURM_TEST") == "1" or (os.environ.get("CI") == "true" and os.geteuid() == 0)


@pytest.mark.skipif(
    not RUN_SLURM,
    reason="starts Slurm daemons as root; set TITANLITE_SLURM_TEST=1 to run scripts/slurm_local_test.sh",
)
def test_slurm_end_to_end():
    out = subprocess.run(
        [str(REPO / "scripts" / "slurm_local_test.sh")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "PASS" in out.stdout and "PASS: fault-tolerant job" in out.stdout
