#!/usr/bin/env bash
# Train on this one machine: torchrun starts NGPU workers (CPU + gloo where there is no GPU).
#
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./scripts/run_train.sh --training.steps 10
#
# Arguments are forwarded to titanlite.train as CLI overrides. CONFIG_FILE is relative to the current
# directory. Uses the repo's .venv python if there is one, and this checkout's titanlite.
# MAX_RESTARTS=N (default 0): when a worker dies, torchrun restarts all of them up to N times and
# the trainer resumes from the newest checkpoint (needs --checkpoint.enable true).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NGPU=${NGPU:-8}
MAX_RESTARTS=${MAX_RESTARTS:-0}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}

PYTHON=python3
if [[ -x $REPO/.venv/bin/python ]]; then
    PYTHON=$REPO/.venv/bin/python
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# Restarted workers must not share torchrun's rendezvous store: they would read the failed attempt's
# addresses from it (pytorch/pytorch#135712); the trainer refuses restarts without this.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# python -m torch.distributed.run is torchrun, run by the interpreter chosen above.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" --max-restarts "$MAX_RESTARTS" \
    -m titanlite.train --job.config_file "$CONFIG_FILE" "$@"
