#!/usr/bin/env bash
# GRPO quick start, no downloads (docs/grpo.md, "A worked example"): a tokenizer and an arithmetic task generated
# here, the debug model fine-tuned on worked answers, then train_configs/debug_grpo.toml rewards right answers.
# Extra flags go to the GRPO run, e.g. --rl.beta 0.04 or --lora.rank 8 --optimizer.lr 2e-3
# A stage that fails or is stopped ends the script with a sentence naming it; rerunning resumes it (scripts/stages.sh).
source "$(dirname "$0")/env.sh"
source scripts/stages.sh
stage 1 "the tokenizer" outputs/chat_example/tokenizer/tokenizer.json \
    "$PY" -m titanlite.examples.chat_example --output outputs/chat_example
stage 2 "the arithmetic task" outputs/arithmetic/prompts.jsonl \
    "$PY" -m titanlite.examples.arithmetic --out outputs/arithmetic --count 8000
stage 3 "the fine-tuning on worked answers" outputs/arithmetic_sft/checkpoint/step-600-hf/config.json \
    "$PY" -m titanlite.train \
    --job.config_file train_configs/debug_model.toml --job.dump_folder outputs/arithmetic_sft \
    --job.description "debug model fine-tuned on worked arithmetic answers" \
    --model.hf_assets_path outputs/chat_example/tokenizer --training.dataset_format chat \
    --training.dataset_path outputs/arithmetic/sft.jsonl --training.seq_len 256 --training.local_batch_size 8 \
    --training.steps 600 \
    --optimizer.lr 3e-3 --lr_scheduler.warmup_steps 20 --training.mixed_precision_param float32 \
    --metrics.log_freq 100 --checkpoint.enable --checkpoint.last_save_in_hf
last_stage 4 "GRPO" "$PY" -m titanlite.train --job.config_file train_configs/debug_grpo.toml "$@"
