#!/usr/bin/env bash
# Re-makes assets/dashboard.png, the README's picture of the TensorBoard dashboard: trains the
# shipped debug config (with validation and async checkpoints, so every section has data), starts
# the real tensorboard on a free local port and screenshots its page with headless Chromium.
#   ./scripts/dashboard_screenshot.sh [page]    page: custom_scalars (default: the layout titanlite writes),
#                                               timeseries, scalars, text or hparams (into assets/dashboard_<page>.png)
#   ./scripts/dashboard_screenshot.sh objectives
#                                               the custom scalars of a short GRPO run (with an in-loop lm-eval task)
#                                               and a DPO run, a chart per tag in their RL, DPO and eval sections,
#                                               into docs/images/dashboard_objectives.png
# Needs Debian's chromium (apt-get install -y chromium) and the project's .venv (PYTHON=path/to/python for another
# environment's, with tensorboard beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
page=${1:-custom_scalars}
out=assets/dashboard${1:+_$1}.png
height=1350
work=$(mktemp -d)
tb_pid=""
cleanup() {
    if [[ -n $tb_pid ]]; then kill "$tb_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
train() { OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$py" -m titanlite.train --job.config_file train_configs/debug_model.toml \
    --metrics.enable_tensorboard true --metrics.log_freq 1 "$@"; }

if [[ $page == objectives ]]; then
    page=custom_scalars out=docs/images/dashboard_objectives.png height=4200
    "$py" - "$work" <<'PY'
import json, random, sys
from pathlib import Path
work, rng = Path(sys.argv[1]), random.Random(0)
(work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i}: say eeee"}) + "\n" for i in range(16)))
(work / "rewards.py").write_text("def letter_share(completions, **kwargs):\n"
                                 "    return [text.count('e') / max(len(text), 1) for text in completions]\n")
words = "alpha beta gamma delta epsilon zeta eta theta".split()
(work / "tasks").mkdir()
(work / "tasks" / "data.jsonl").write_text("".join(json.dumps(
    {"question": " ".join(rng.choices(words, k=5)), "choices": [" ".join(rng.choices(words, k=2)) for _ in range(4)],
     "answer": rng.randrange(4)}) + "\n" for _ in range(8)))
(work / "tasks" / "tiny_mc.yaml").write_text(
    f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {work}/tasks/data.jsonl\n"
    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
PY
    "$py" -m titanlite.examples.chat_example --output "$work/chat_example" >/dev/null
    train --job.dump_folder "$work/run" --job.description "GRPO, toy reward" --training.steps 12 --training.dataset_format prompts \
        --training.dataset_path "$work/prompts.jsonl" --training.seq_len 48 --training.local_batch_size 8 \
        --training.global_batch_size 8 --rl.num_generations 4 --rl.max_new_tokens 12 \
        --rl.reward_functions "$work/rewards.py:letter_share" --rl.beta 0.05 --rl.num_iterations 2 \
        --training.mixed_precision_param float32 --optimizer.lr 3e-3 --lr_scheduler.warmup_steps 0 \
        --eval.tasks tiny_mc --eval.include_path "$work/tasks" --eval.interval 4
    train --job.dump_folder "$work/run" --job.description "DPO, the example pairs" --training.steps 12 \
        --model.hf_assets_path "$work/chat_example/tokenizer" --training.dataset_format preference \
        --training.dataset_path assets/preference_example.jsonl --training.seq_len 128 \
        --training.local_batch_size 4 --training.global_batch_size 4 --optimizer.lr 1e-4
else
    train --job.dump_folder "$work/run" \
        --validation.enable true --validation.freq 10 --validation.steps 4 \
        --checkpoint.enable true --checkpoint.interval 10 --checkpoint.async_mode async
fi

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
    --window-size=1400,$height --virtual-time-budget=20000 --screenshot="$work/page.png" \
    "http://127.0.0.1:$port/#$page" 2>"$work/chromium.log"
# 256 colours keep the PNG small (the README's picture should stay well under 300 KB).
"$py" -c 'import sys; from PIL import Image; Image.open(sys.argv[1]).convert("RGB").quantize(256).save(sys.argv[2], optimize=True)' \
    "$work/page.png" "$out"
echo "wrote $out ($(du -k "$out" | cut -f1) KB)"
