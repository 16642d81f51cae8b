#!/usr/bin/env bash
# One command, one GPU, under 10 minutes: everything a CPU cannot show.
#
#   ./scripts/gpu_check.sh [OUT_DIR]        # default outputs/gpu_check
#
# 1. the CUDA test tier (pytest -m cuda);
# 2. Llama 3.2 1B (H100; 3B on an H200) bf16 + compile + selective op AC at seq 8192: tps, MFU,
#    peak memory, and the planner's predicted peak memory and tps beside them (the trainer logs both);
# 3. the same with float8 (tensorwise), and with training.loss_chunk_tokens 4096 (the chunked output
#    projection + loss: its speed against step 2's is unmeasured until this runs);
# 4. training time lost to checkpoint saves: async_with_pinned_mem vs a sync save;
# 5. a CUDA memory snapshot (open it at pytorch.org/memory_viz).
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md (titanlite/plan/gpu_report.py) and the logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-outputs/gpu_check}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU is visible (torch.cuda.is_available() is false); run it on a GPU machine" >&2
    exit 1
fi
GPU_NAME=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())")
case $GPU_NAME in
    *H200*) FLAVOR=3B CONFIG=train_configs/llama3_3b.toml PLAN_GPU=H200 ;;
    *H100*PCIe*) FLAVOR=1B CONFIG=train_configs/llama3_1b.toml PLAN_GPU="H100 PCIe" ;;
    *) FLAVOR=1B CONFIG=train_configs/llama3_1b.toml PLAN_GPU="H100 SXM" ;;
esac
echo "gpu_check: $GPU_NAME -> llama3 $FLAVOR, planned as $PLAN_GPU; results in $OUT"

# 1. The CUDA tier (a failure is reported, and the measurements still run).
"$PYTHON" -m pytest -m cuda -q tests >"$OUT/cuda_tests.log" 2>&1 && echo "cuda tests: passed" \
    || echo "cuda tests: FAILED (see $OUT/cuda_tests.log)"

# Synthetic tokens with the shipped tokenizer: nothing to download.
COMMON=(--job.config_file "$CONFIG" --model.tokenizer_path= --training.dataset synthetic
    --training.local_batch_size 2 --training.seq_len 8192 --metrics.log_freq 10 --metrics.summary_warmup_steps 10
    --compile.enable --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op
    --plan.gpu "$PLAN_GPU" --plan.nodes 1 --plan.gpus_per_node 1)
train() {  # NAME, flags...
    local name=$1
    shift
    NGPU=1 ./scripts/run_train.sh "${COMMON[@]}" --job.dump_folder "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
        || echo "gpu_check: run $name failed (see $OUT/$name.log)"
}
train bf16 --training.steps 40 --float8.enable false --float8.enable_fsdp_float8_all_gather false \
    --float8.precompute_float8_dynamic_scale_for_fsdp false
train float8 --training.steps 40 --float8.enable --float8.enable_fsdp_float8_all_gather false \
    --float8.precompute_float8_dynamic_scale_for_fsdp false
train bf16_loss_chunks --training.steps 40 --float8.enable false --float8.enable_fsdp_float8_all_gather false \
    --float8.precompute_float8_dynamic_scale_for_fsdp false --training.loss_chunk_tokens 4096
for mode in disabled async_with_pinned_mem; do
    train "save_$mode" --training.steps 30 --float8.enable false --float8.enable_fsdp_float8_all_gather false \
        --float8.precompute_float8_dynamic_scale_for_fsdp false --checkpoint.enable --checkpoint.interval 10 \
        --checkpoint.async_mode "$mode" --profiling.enable_memory_snapshot --profiling.profile_freq 20
done

"$PYTHON" -m titanlite.plan.gpu_report "$OUT" bf16="$OUT/bf16.log" float8="$OUT/float8.log" \
    bf16_loss_chunks="$OUT/bf16_loss_chunks.log" \
    save_sync="$OUT/save_disabled.log" save_async_pinned="$OUT/save_async_with_pinned_mem.log"
echo "gpu_check: memory snapshots under $OUT/save_disabled/memory_snapshot"
