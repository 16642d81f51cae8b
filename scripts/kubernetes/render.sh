#!/usr/bin/env bash
# Print a manifest template with its ${VAR}s filled from the environment.
#
#   JOB_NAME=llama3-8b NUM_NODES=4 GPU_PER_NODE=8 EFA_PER_NODE=32 MAX_RESTARTS=3 \
#   IMAGE_URI=123456789012.dkr.ecr.us-east-1.amazonaws.com/titanlite:latest \
#   CONFIG_FILE=train_configs/llama3_8b.toml DUMP_FOLDER=/checkpoints/llama3-8b CHECKPOINT_PVC=fsx-claim \
#   scripts/kubernetes/render.sh [TEMPLATE] > job.yaml
#
# Before rendering, python -m titanlite.plan (CPU, seconds; PYTHON picks the interpreter [python3])
# checks that CONFIG_FILE fits NUM_NODES x GPU_PER_NODE GPUs and refuses a job that does not;
# TITANLITE_SKIP_PLAN=1 skips the check.
# TEMPLATE defaults to pytorchjob.yaml.template next to this script. Every variable the template
# uses must be set and non-empty; only those variables are substituted (envsubst, from gettext-base).
set -euo pipefail

TEMPLATE=${1:-$(dirname "${BASH_SOURCE[0]}")/pytorchjob.yaml.template}
NUMERIC="NUM_NODES GPU_PER_NODE EFA_PER_NODE MAX_RESTARTS"

[[ -f $TEMPLATE ]] || { echo "render.sh: no template at $TEMPLATE" >&2; exit 1; }
command -v envsubst >/dev/null || {
    echo "render.sh: envsubst not found; install gettext-base (apt-get install gettext-base)" >&2
    exit 1
}

# The template's variables, literally "${NAME}" (hence the single quotes here and below).
# shellcheck disable=SC2016
mapfile -t VARS < <(grep -o '\${[A-Za-z_][A-Za-z0-9_]*}' "$TEMPLATE" | tr -d '${}' | sort -u)

missing=() bad=()
for v in "${VARS[@]}"; do
    if [[ -z ${!v:-} ]]; then
        missing+=("$v")
    elif [[ " $NUMERIC " == *" $v "* && ! ${!v} =~ ^[0-9]+$ ]]; then
        bad+=("$v=${!v}")
    fi
done
if ((${#missing[@]})); then
    echo "render.sh: set ${missing[*]} (used by $TEMPLATE)" >&2
    exit 1
fi
if ((${#bad[@]})); then
    echo "render.sh: ${bad[*]} must be a whole number" >&2
    exit 1
fi

if [[ ${TITANLITE_SKIP_PLAN:-0} != 1 && -n ${CONFIG_FILE:-} ]]; then
    # From the repository root, where CONFIG_FILE's relative path points (as in the image).
    if ! (cd "$(dirname "${BASH_SOURCE[0]}")/../.." && "${PYTHON:-python3}" -m titanlite.plan --job.config_file "$CONFIG_FILE" --plan.nodes "$NUM_NODES" \
            --plan.gpus_per_node "$GPU_PER_NODE" >&2); then
        echo "render.sh: not rendered: python -m titanlite.plan says $CONFIG_FILE does not fit $NUM_NODES node(s) x $GPU_PER_NODE GPUs (see above); apply its advice, or set TITANLITE_SKIP_PLAN=1" >&2
        exit 1
    fi
fi

# shellcheck disable=SC2016
envsubst "$(printf '${%s} ' "${VARS[@]}")" <"$TEMPLATE"
