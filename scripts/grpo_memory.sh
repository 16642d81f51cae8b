#!/usr/bin/env bash
# Peak memory (maximum resident set size, /usr/bin/time -v) and wall time of the GRPO worked example's last stage,
# titanlite's (train_configs/debug_grpo.toml) against TRL 1.16's GRPOTrainer on the same task (scripts/grpo_trl.py),
# one after the other, one thread each; docs/benchmarks.md has the measured rows. Needs the fine-tuned folder of
# ./scripts/grpo_debug.sh's first stages. Extra flags go to both: --steps N (default 60).
source "$(dirname "$0")/env.sh"
steps=60
[ "${1:-}" = "--steps" ] && steps=$2
[ -f outputs/arithmetic_sft/checkpoint/step-600-hf/config.json ] || {
    echo "grpo_memory.sh: outputs/arithmetic_sft/checkpoint/step-600-hf is missing; run ./scripts/grpo_debug.sh first" >&2
    exit 2
}
work=$(mktemp -d)
measure() {  # NAME COMMAND...: the command's last line and its peak RSS
    local name=$1
    shift
    OMP_NUM_THREADS=1 /usr/bin/time -v "$@" >"$work/$name.log" 2>&1 || { tail -20 "$work/$name.log"; exit 1; }
    local rss wall
    rss=$(grep "Maximum resident set size" "$work/$name.log" | awk '{print $NF}')
    wall=$(grep "Elapsed (wall clock)" "$work/$name.log" | awk '{print $NF}')
    echo "$name: peak RSS $((rss / 1024)) MiB, wall $wall"
}
measure titanlite "$PY" -m titanlite.train --job.config_file train_configs/debug_grpo.toml \
    --job.dump_folder "$work/titanlite" --training.steps "$steps" --checkpoint.enable false
measure titanlite_full_ac "$PY" -m titanlite.train --job.config_file train_configs/debug_grpo.toml \
    --job.dump_folder "$work/titanlite_ac" --training.steps "$steps" --checkpoint.enable false \
    --activation_checkpoint.mode full
measure trl "$PY" scripts/grpo_trl.py --steps "$steps" --output "$work/trl"
measure trl_no_checkpointing "$PY" scripts/grpo_trl.py --steps "$steps" --output "$work/trl_nockpt" \
    --gradient_checkpointing false
echo "logs in $work"
