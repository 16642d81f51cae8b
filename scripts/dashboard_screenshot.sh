#!/usr/bin/env bash
# Re-makes assets/dashboard.png, the README's picture of the TensorBoard dashboard: trains the
# shipped debug config (with validation and async checkpoints, so every section has data), starts
# the real tensorboard on a free local port and screenshots its page with headless Chromium.
#   ./scripts/dashboard_screenshot.sh [page]    page: custom_scalars (default: the layout titanlite writes),
#                                               timeseries, scalars, text or hparams (into assets/dashboard_<page>.png)
# Needs Debian's chromium (apt-get install -y chromium) and the project's .venv (PYTHON=path/to/python for another
# environment's, with tensorboard beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
page=${1:-custom_scalars}
out=assets/dashboard${1:+_$1}.png
work=$(mktemp -d)
tb_pid=""
cleanup() {
    if [[ -n $tb_pid ]]; then kill "$tb_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$py" -m titanlite.train --job.config_file train_configs/debug_model.toml \
    --job.dump_folder "$work/run" --metrics.enable_tensorboard true --metrics.log_freq 1 \
    --validation.enable true --validation.freq 10 --validation.steps 4 \
    --checkpoint.enable true --checkpoint.interval 10 --checkpoint.async_mode async

port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$(dirname "$py")/tensorboard" --logdir "$work/run/tb" --host 127.0.0.1 --port "$port" >"$work/tensorboard.log" 2>&1 &
tb_pid=$!
for _ in $(seq 60); do
    curl -sf "http://127.0.0.1:$port/data/plugin/scalars/tags" | grep -q "loss/train" && break
    sleep 0.5
done

# A fresh profile and no network beyond 127.0.0.1; the virtual-time budget lets the charts draw.
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$work/chromium" --hide-scrollbars \
    --window-size=1400,1350 --virtual-time-budget=20000 --screenshot="$work/page.png" \
    "http://127.0.0.1:$port/#$page" 2>"$work/chromium.log"
# 256 colours keep the PNG small (the README's picture should stay well under 300 KB).
"$py" -c 'import sys; from PIL import Image; Image.open(sys.argv[1]).convert("RGB").quantize(256).save(sys.argv[2], optimize=True)' \
    "$work/page.png" "$out"
echo "wrote $out ($(du -k "$out" | cut -f1) KB)"
