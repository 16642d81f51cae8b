#!/usr/bin/env bash
# End-to-end test of multinode_trainer.slurm on this one machine, CPU only:
# start a private one-node Slurm cluster (munged, slurmctld, slurmd), sbatch a short debug run
# through the real batch script, and check that it trained, checkpointed and COMPLETED.
#
#   sudo scripts/slurm_local_test.sh        # as root; installs slurm-wlm and munge with apt-get if missing
#
# Everything it starts (daemons, state, logs, the run's dump folder) lives in one temp folder and is
# stopped/removed on exit, so it can run repeatedly. It touches nothing in /etc: the daemons read the
# slurm.conf written here (SLURM_CONF) and talk through a private munged with its own key and socket.
#
# Environment:
#   SLURM_TEST_TIMEOUT      seconds to wait for the job [600]
#   SLURM_TEST_CTLD_PORT, SLURM_TEST_SLURMD_PORT   daemon ports [6817, 6818]
#   SLURM_TEST_KEEP         1: keep the temp folder (logs, dump) for a look afterwards [0]
#   VENV                    python environment for the job [the repo's .venv, if any]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TIMEOUT=${SLURM_TEST_TIMEOUT:-600}
CTLD_PORT=${SLURM_TEST_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_TEST_SLURMD_PORT:-6818}
CONFIG_FILE=train_configs/debug_model.toml
STEPS=6
CKPT_INTERVAL=3

log() { echo "[slurm_local_test] $*"; }
fail() { log "FAIL: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || fail "run as root: it installs packages and starts Slurm daemons as SlurmUser=root."
[[ -f $REPO/$CONFIG_FILE ]] || fail "$REPO/$CONFIG_FILE is missing."

# --- 1. Packages -------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
    ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq </dev/null
    apt-get install -y -qq --no-install-recommends slurm-wlm munge </dev/null >/dev/null
fi

if [[ -z ${VENV:-} && -x $REPO/.venv/bin/python ]]; then
    VENV=$REPO/.venv
fi
if [[ -n ${VENV:-} ]]; then
    [[ -x $VENV/bin/torchrun ]] || fail "VENV=$VENV has no bin/torchrun."
    export VENV
else
    command -v torchrun >/dev/null || fail "no torchrun on PATH and no .venv in $REPO; set VENV."
fi

for port in "$CTLD_PORT" "$SLURMD_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        fail "port $port is in use (another Slurm?); pick free ones with SLURM_TEST_CTLD_PORT/SLURM_TEST_SLURMD_PORT."
    fi
done

# --- 2. Cleanup, armed before anything starts ----------------------------------------------------
WORK=$(mktemp -d /tmp/titanlite-slurm-test.XXXXXX)
# munged wants its socket's folders executable by all (and its key's folder private, below).
chmod 755 "$WORK"
MUNGED_PID="" CTLD_PID="" SLURMD_PID="" JOB_ID=""

stop_pid() { # stop_pid PID: SIGTERM, wait up to 15 s, then SIGKILL
    local pid=$1 i
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    if [[ -n $JOB_ID && -n $CTLD_PID ]] && ! job_done; then
        # Cancelling lets slurmd's step daemon kill the job's processes (torchrun and its workers).
        scancel "$JOB_ID" 2>/dev/null || true
        wait_for 30 job_done
    fi
    stop_pid "$SLURMD_PID"
    stop_pid "$CTLD_PID"
    stop_pid "$MUNGED_PID"
    if [[ ${SLURM_TEST_KEEP:-0} == 1 ]]; then
        log "kept $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

job_state() { scontrol show job -o "$JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
job_done() {
    case $(job_state) in
        PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | RESIZING | SIGNALING | STAGE_OUT) return 1 ;;
        *) return 0 ;;
    esac
}

wait_for() { # wait_for SECONDS CMD...: poll CMD every half second until it succeeds
    local secs=$1 i
    shift
    for ((i = 0; i < secs * 2; i++)); do
        "$@" && return 0
        sleep 0.5
    done
    return 1
}

# --- 3. munge: a private key and daemon -----------------------------------------------------------
mkdir -m 700 "$WORK/munge"
mkdir -m 755 "$WORK/munge-socket"
mungekey --create --keyfile="$WORK/munge/munge.key" 2>/dev/null ||
    dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"
MUNGE_SOCKET=$WORK/munge-socket/munge.socket
munged --foreground --socket="$MUNGE_SOCKET" --key-file="$WORK/munge/munge.key" \
    --pid-file="$WORK/munge/munged.pid" --seed-file="$WORK/munge/munged.seed" \
    --log-file="$WORK/munge/munged.log" >"$WORK/munge/munged.out" 2>&1 &
MUNGED_PID=$!
wait_for 20 [ -S "$MUNGE_SOCKET" ] || fail "munged did not start: $(cat "$WORK/munge/munged.out")"
munge --socket="$MUNGE_SOCKET" -n </dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null ||
    fail "munge cannot encode/decode a credential: $(cat "$WORK/munge/munged.out" "$WORK/munge/munged.log" 2>/dev/null)"

# --- 4. slurm.conf for this one node -----------------------------------------------------------------
NODE=$(hostname -s)
# torchrun's rendezvous goes to the node name the batch script reads from Slurm.
getent hosts "$NODE" >/dev/null || fail "this host's name $NODE does not resolve; add it to /etc/hosts."
CPUS=$(nproc)
# RealMemory: 90% of what free(1) calls total (read from /proc/meminfo, which is where free gets it and
# which minimal images have without procps), so slurmd never drains the node for "Low RealMemory".
MEM_MB=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
JOB_CPUS=$((CPUS < 2 ? CPUS : 2))
mkdir -p "$WORK/ctld" "$WORK/slurmd"
export SLURM_CONF=$WORK/slurm.conf
cat >"$SLURM_CONF" <<EOF
# Written by scripts/slurm_local_test.sh: one node, no cgroups, no accounting database.
ClusterName=titanlite-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$WORK/ctld
SlurmdSpoolDir=$WORK/slurmd
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
# No cgroups (containers and CI VMs often lack a delegated cgroup tree): track a job's processes
# through /proc (linuxproc also finds the workers torchrun starts in sessions of their own, so they
# get --signal and scancel; pgid would miss them), bind nothing, gather no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No AccountingStorageType, so no slurmdbd and no sacct: the test reads the final state from
# scontrol, which keeps finished jobs for MinJobAge seconds.
MinJobAge=3600
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# --- 5. Daemons ----------------------------------------------------------------------------------------
log "starting slurmctld and slurmd for node $NODE ($CPUS CPUs, ${MEM_MB} MB) in $WORK"
slurmctld -D -f "$SLURM_CONF" >"$WORK/slurmctld.out" 2>&1 &
CTLD_PID=$!
wait_for 30 scontrol ping >/dev/null 2>&1 || fail "slurmctld did not answer: $(tail -n 20 "$WORK/slurmctld.log" "$WORK/slurmctld.out" 2>&1)"
slurmd -D -f "$SLURM_CONF" >"$WORK/slurmd.out" 2>&1 &
SLURMD_PID=$!
node_idle() { [[ $(sinfo -h -N -n "$NODE" -o %t 2>/dev/null) == idle ]]; }
if ! wait_for 60 node_idle; then
    log "--- slurmd log"; tail -n 30 "$WORK/slurmd.log" "$WORK/slurmd.out" 2>/dev/null || true
    log "--- slurmctld log"; tail -n 30 "$WORK/slurmctld.log" 2>/dev/null || true
    fail "node $NODE never became idle: $(sinfo -h -N -n "$NODE" -o '%t %E' 2>&1)"
fi

# --- 6. The jobs: the real batch script, resources overridden for CPU -------------------------------
cd "$REPO"
submit() { # submit LOG [VAR=VALUE ...] -- TRAINER_FLAGS...: sbatch the batch script with that environment, wait for it
    local job_log=$1 envs=() start=$SECONDS
    shift
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    JOB_ID=$(env "${envs[@]}" NPROC_PER_NODE=2 CONFIG_FILE=$CONFIG_FILE RDZV_PORT=${RDZV_PORT:-29500} \
        sbatch --parsable --nodes=1 --gpus-per-task=0 --cpus-per-task="$JOB_CPUS" \
        --time=$(((TIMEOUT + 59) / 60)) --output="$job_log" multinode_trainer.slurm "$@")
    JOB_ID=${JOB_ID%%;*}
    log "submitted job $JOB_ID: ${envs[*]} multinode_trainer.slurm $*"
    while ! job_done; do
        if ((SECONDS - start > TIMEOUT)); then
            log "--- job log"; cat "$job_log" 2>/dev/null || true
            fail "job $JOB_ID still $(job_state) after ${TIMEOUT}s"
        fi
        sleep 2
    done
    log "job $JOB_ID finished in $((SECONDS - start))s"
    STATE=$(scontrol show job -o "$JOB_ID" | grep -o 'JobState=[A-Z_]* .*ExitCode=[0-9:]*' | sed 's/ .*ExitCode=/ ExitCode=/' || true)
}

report() { # report LOG: the problems found, with the logs, or nothing
    ((${#problems[@]})) || return 0
    log "--- job log ($1)"
    cat "$1" || true
    log "--- slurmd log (tail)"
    tail -n 20 "$WORK/slurmd.log" || true
    for p in "${problems[@]}"; do log "problem: $p"; done
    fail "job $JOB_ID"
}

DUMP=$WORK/dump
JOB_LOG=$WORK/job.log
submit "$JOB_LOG" -- --training.steps "$STEPS" --job.dump_folder "$DUMP" --checkpoint.enable true --checkpoint.interval "$CKPT_INTERVAL"

# --- 7. Checks ------------------------------------------------------------------------------------------
problems=()
[[ $STATE == "JobState=COMPLETED ExitCode=0:0" ]] || problems+=("job ended $STATE, not COMPLETED ExitCode=0:0")
grep -q "x 2 workers" "$JOB_LOG" || problems+=("the batch script did not start 2 workers (NPROC_PER_NODE)")
[[ -d $DUMP ]] || problems+=("no dump folder $DUMP: the arguments after the script name did not reach the trainer")
# The trainer logs "HH:MM:SS INFO step: 5  loss: ..."; torchrun may prefix "[rank0]:".
STEP_LINES=$(grep -cE '(^|[] ])step: *[0-9]+' "$JOB_LOG" || true)
((STEP_LINES > 0)) || problems+=("no 'step:' lines in the job log")
CKPT=$DUMP/checkpoint/step-$STEPS
[[ -f $CKPT/.metadata ]] || problems+=("no complete checkpoint at $CKPT (no .metadata)")
report "$JOB_LOG"
log "PASS: job $JOB_ID $STATE, $STEP_LINES step lines, checkpoint $CKPT"

# --- 8. The fault-tolerant mode (FT_GROUPS): the lighthouse and one replica group, on a token store -------
PYTHON=${VENV:+$VENV/bin/}python3
"$PYTHON" -m titanlite.data.prepare --input sample --output "$WORK/store" >/dev/null 2>&1 || fail "could not prepare a token store"
FT_LOG=$WORK/ft.log
submit "$FT_LOG" FT_GROUPS=1 FT_DUMP_FOLDER="$WORK/ft" -- --training.steps 4 --training.dataset_path "$WORK/store" \
    --checkpoint.enable true --checkpoint.interval 4
problems=()
[[ $STATE == "JobState=COMPLETED ExitCode=0:0" ]] || problems+=("FT job ended $STATE, not COMPLETED ExitCode=0:0")
grep -q "fault-tolerant mode, 1 replica groups" "$FT_LOG" || problems+=("the batch script did not start its FT mode")
grep -q "replica groups training" "$FT_LOG" || problems+=("no quorum line: the group did not meet the lighthouse")
[[ -f $WORK/ft/replica_0/checkpoint/step-4/.metadata ]] || problems+=("no checkpoint of replica group 0 at step 4")
report "$FT_LOG"
log "PASS: fault-tolerant job $JOB_ID $STATE, replica group 0 checkpointed step 4"
