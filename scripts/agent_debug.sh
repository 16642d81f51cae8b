#!/usr/bin/env bash
# Agents quick start, no downloads (docs/agents.md): the arithmetic task answered with a calculator tool. The debug
# model is fine-tuned on conversations that call the tool (records with TRL's `tools`), then
# train_configs/debug_agent.toml trains it with GRPO in a calculator environment, rewarding right answers.
# Extra flags go to the GRPO run, e.g. --rl.max_tool_calling_iterations 1
# A stage that fails or is stopped ends the script with a sentence naming it; rerunning resumes it (scripts/stages.sh).
source "$(dirname "$0")/env.sh"
source scripts/stages.sh
stage 1 "the tokenizer" outputs/chat_example/tokenizer/tokenizer.json \
    "$PY" -m titanlite.examples.chat_example --output outputs/chat_example
stage 2 "the arithmetic task with a calculator" outputs/arithmetic_tools/prompts.jsonl \
    "$PY" -m titanlite.examples.arithmetic_tools --out outputs/arithmetic_tools --count 8000
stage 3 "the fine-tuning on tool-calling answers" outputs/arithmetic_tools_sft/checkpoint/step-200-hf/config.json \
    "$PY" -m titanlite.train \
    --job.config_file train_configs/debug_model.toml --job.dump_folder outputs/arithmetic_tools_sft \
    --job.description "debug model fine-tuned to answer arithmetic with a calculator tool" \
    --model.hf_assets_path outputs/chat_example/tokenizer --training.dataset_format chat \
    --training.dataset_path outputs/arithmetic_tools/sft.jsonl \
    --training.chat_template outputs/arithmetic_tools/tool_template.jinja \
    --training.seq_len 288 --training.local_batch_size 8 --training.steps 200 \
    --optimizer.lr 3e-3 --lr_scheduler.warmup_steps 20 --lr_scheduler.min_lr_factor 1.0 \
    --training.mixed_precision_param float32 \
    --metrics.log_freq 25 --checkpoint.enable --checkpoint.last_save_in_hf
last_stage 4 "GRPO with the calculator" "$PY" -m titanlite.train --job.config_file train_configs/debug_agent.toml "$@"
