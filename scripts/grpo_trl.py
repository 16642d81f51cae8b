"""The GRPO worked example's last stage (train_configs/debug_grpo.toml) run by TRL 1.16's GRPOTrainer instead, for
the peak-memory and step-time comparison in docs/benchmarks.md (scripts/grpo_memory.sh runs both under
/usr/bin/time -v): the same fine-tuned folder, prompts and reward function (titanlite.rewards:math_answer has TRL's
signature), 16 prompts x 8 completions of up to 32 tokens a step, micro-batches of 32, lr 2e-4 after 5 warm-up
steps, loss dapo, no KL, fp32 on the CPU.

    python scripts/grpo_trl.py [--model outputs/arithmetic_sft/checkpoint/step-600-hf] [--steps 60]
                               [--gradient_checkpointing true|false] [--output /tmp/trl_grpo]
"""

import argparse
import time

import datasets
from trl import GRPOConfig, GRPOTrainer

from titanlite.rewards import math_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/arithmetic_sft/checkpoint/step-600-hf")
    parser.add_argument("--prompts", default="outputs/arithmetic/prompts.jsonl")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--gradient_checkpointing",
        default="true",
        choices=("true", "false"),
        help="TRL's default is true; titanlite's activation_checkpoint.mode is none",
    )
    parser.add_argument("--output", default="/tmp/trl_grpo")
    args = parser.parse_args()
    config = GRPOConfig(
        output_dir=args.output,
        use_cpu=True,
        bf16=False,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=4,
        num_generations=8,
        max_completion_length=32,
        temperature=1.0,
        loss_type="dapo",
        beta=0.0,
        learning_rate=2e-4,
        warmup_steps=5,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing == "true",
    )
    prompts = datasets.load_dataset("json", data_files=args.prompts, split="train")
    trainer = GRPOTrainer(model=args.model, reward_funcs=[math_answer], args=config, train_dataset=prompts)
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    print(f"TRL GRPO: {args.steps} steps in {seconds:.1f}s ({seconds / args.steps:.2f} s/step)")


if __name__ == "__main__":
    main()
