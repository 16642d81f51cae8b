#!/usr/bin/env bash
# Quick start: train the debug model on the shipped sample corpus (GPU if present, else CPU).
# Extra flags are forwarded, e.g. ./scripts/train_debug.sh --training.steps 100
source "$(dirname "$0")/env.sh"
exec "$PY" -m titanlite.train --job.config_file train_configs/debug_model.toml "$@"
