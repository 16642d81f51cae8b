"""Entry point: python -m titanlite.eval --tasks T [--include_path DIR] [--limit N] [--num_fewshot K]
    [--output_path DIR] [--log_samples] [--batch_size B] --model_args hf_assets_path=F | config_file=X.toml,checkpoint=STEP[,section.key=value...]

lm-eval 0.4's run flags (the ones of `lm_eval run` that apply to one local model) with titanlite as its model
(titanlite/inference/: eval_job.py, lm_eval_model.py): the tasks run as lm-eval runs them, the results JSON (and
with --log_samples each task's samples) is lm-eval's own, written under --output_path by its EvaluationTracker, and
lm-eval's results table is printed. Under torchrun the ranks share the requests (the weights sharded by FSDP where
parallelism says so); rank 0 prints and writes the results.
"""

import argparse
import os
import sys

from titanlite.errors import UserError, exit_code
from titanlite.inference.eval_job import evaluate_model, evaluation_config, results_table
from titanlite.inference.model import build_inference_model
from titanlite.inference.tasks import task_manager, write_results
from titanlite.log import init_logger
from titanlite.parallel.dist import close_distributed, init_distributed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titanlite.eval", description=__doc__.split("\n\n")[1])
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument("--model_args", default="", help="hf_assets_path=F, or config_file=X.toml,checkpoint=STEP, plus section.key=value overrides")
    parser.add_argument("--include_path", default=None, help="folder of extra task YAML files")
    parser.add_argument("--limit", type=float, default=None, help="at most this many examples per task (a fraction below 1)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples in each prompt")
    parser.add_argument("--output_path", default=None, help="folder for lm-eval's results JSON (and samples)")
    parser.add_argument("--log_samples", action="store_true", help="also write every example's inputs and outputs")
    parser.add_argument("--batch_size", default="1", help="sequences per forward")
    args = parser.parse_args(argv)
    if args.log_samples and not args.output_path:
        raise UserError("--log_samples writes the samples under --output_path; set --output_path")
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit {args.limit:g} leaves no examples to evaluate; give a count of at least 1, a fraction "
                        "between 0 and 1, or leave it out for every example")
    if not args.batch_size.isdigit() or int(args.batch_size) < 1:
        raise UserError(f"--batch_size {args.batch_size}: titanlite takes a number of sequences per forward of at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num_fewshot {args.num_fewshot} is negative; give 0 or more examples, or leave it out")
    return args


def evaluate(argv: list[str]) -> None:
    args = parse_args(argv)
    init_logger(int(os.environ.get("RANK", 0)))  # under torchrun, rank 0's log alone says more than warnings
    tasks = [task for task in args.tasks.split(",") if task]
    cfg = evaluation_config(args.model_args)
    task_manager(tuple(tasks), args.include_path)  # a bad task stops the run before the model is built
    try:
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        results = evaluate_model(build_inference_model(cfg, info), tasks, args.include_path, batch_size=int(args.batch_size),
                                 limit=args.limit, num_fewshot=args.num_fewshot, log_samples=args.log_samples)
    finally:
        close_distributed()
    if results is None:  # lm-eval hands the results to rank 0 only
        return
    if args.output_path:
        write_results(results, args.output_path, args.log_samples, args.model_args)
    print(results_table(results))


def main(argv: list[str]) -> int:
    return exit_code(evaluate, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
