#!/usr/bin/env bash
# Fine-tuning quick start, no downloads: a chat data set and a tokenizer generated here, a debug base model
# trained on the sample corpus and exported as a Hugging Face folder, then train_configs/debug_finetune.toml
# fine-tunes that folder on the conversations. Extra flags go to the fine-tuning run, e.g. --lora.rank 8 --optimizer.lr 2e-3
# A stage that fails or is stopped ends the script with a sentence naming it; rerunning resumes it (scripts/stages.sh).
source "$(dirname "$0")/env.sh"
source scripts/stages.sh
stage 1 "the chat data and tokenizer" outputs/chat_example/chats.jsonl \
    "$PY" -m titanlite.examples.chat_example --output outputs/chat_example
stage 2 "the base model on the sample corpus" outputs/debug_base/checkpoint/step-40-hf/config.json \
    "$PY" -m titanlite.train --job.config_file train_configs/debug_model.toml --job.dump_folder outputs/debug_base \
    --model.hf_assets_path outputs/chat_example/tokenizer --checkpoint.enable --checkpoint.last_save_in_hf
last_stage 3 "the fine-tuning" "$PY" -m titanlite.train --job.config_file train_configs/debug_finetune.toml "$@"
