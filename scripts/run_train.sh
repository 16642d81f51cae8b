#!/usr/bin/env bash
# Train on this one machine: torchrun starts NGPU workers (CPU + gloo where there is no GPU).
#
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./scripts/run_train.sh --training.steps 10
#
# Arguments are forwarded to titanlite.train as CLI overrides. CONFIG_FILE is relative to the current
# directory. Uses the repo's .venv python if there is one, and this checkout's titanlite.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NGPU=${NGPU:-8}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}

PYTHON=python3
if [[ -x $REPO/.venv/bin/python ]]; then
    PYTHON=$REPO/.venv/bin/python
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

# python -m torch.distributed.run is torchrun, run by the interpreter chosen above.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
    -m titanlite.train --job.config_file "$CONFIG_FILE" "$@"
