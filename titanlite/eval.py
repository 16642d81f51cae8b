"""Entry point: python -m titanlite.eval --tasks T [--include_path DIR] [--limit N] [--num_fewshot K]
    [--output_path DIR] [--log_samples] [--batch_size B] --model_args hf_assets_path=F |
    config_file=X.toml,checkpoint=STEP[,section.key=value...]

lm-eval 0.4's run flags (the ones of `lm_eval run` that apply to one local model) with titanlite as its model
(titanlite/inference/lm_eval_model.py): --model_args read as a titanlite job's config, the tasks checked before the
model is built (inference/tasks.py), lm-eval's simple_evaluate on the job's model (inference/model.py); the tasks run as
lm-eval runs them, the results JSON (and
with --log_samples each task's samples) is lm-eval's own, written under --output_path by its EvaluationTracker, and
lm-eval's results table is printed. Under torchrun the ranks share the requests (the weights sharded by FSDP where
parallelism says so); rank 0 prints and writes the results.
"""

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from titanlite.config import load_config
from titanlite.config_sections import JobConfig
from titanlite.errors import UserError, exit_code
from titanlite.inference.model import InferenceModel, build_inference_model
from titanlite.inference.tasks import evaluate_tasks, task_manager, write_results
from titanlite.log import init_logger, logger
from titanlite.parallel.dist import close_distributed, init_distributed

# --model_args keys that are not section.key overrides, and the config key each one sets.
MODEL_ARG_KEYS = {
    "hf_assets_path": "model.hf_assets_path",
    "config_file": "job.config_file",
    "checkpoint": "generate.checkpoint",
}


def config_argv(arg_dict: dict) -> list[str]:
    """--model_args (parsed by lm-eval) as titanlite.config command-line flags."""
    argv = []
    for key, value in arg_dict.items():
        dotted = MODEL_ARG_KEYS.get(key, key)
        if "." not in dotted:
            raise UserError(
                f"--model_args {key}={value}: titanlite takes {', '.join(MODEL_ARG_KEYS)} or section.key=value "
                "overrides of its config (e.g. training.param_dtype=bfloat16)"
            )
        argv += [f"--{dotted}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def evaluation_config(model_args: str) -> JobConfig:
    """The job config that --model_args names: hf_assets_path=F, or config_file=X.toml,checkpoint=STEP, plus
    section.key=value overrides."""
    from lm_eval.utils import simple_parse_args_string

    return load_config(config_argv(simple_parse_args_string(model_args)))


def evaluate_model(
    loaded: InferenceModel,
    tasks: list[str],
    include_path: str | None,
    *,
    batch_size: int,
    limit: float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict | None:
    """lm-eval's results dict for `tasks` on `loaded`, its real evaluation time in it (None on ranks other than 0,
    to which lm-eval hands the results)."""
    from titanlite.inference.lm_eval_model import TitanliteLM

    started, lm = time.perf_counter(), TitanliteLM(loaded, batch_size=batch_size)
    results = evaluate_tasks(lm, tasks, include_path, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
    logger.info(f"evaluated {', '.join(tasks)} in {time.perf_counter() - started:.2f}s: {lm.speed.line()}")
    if results is not None:
        results["total_evaluation_time_seconds"] = str(time.perf_counter() - started)
    return results


def results_table(results: dict) -> str:
    """lm-eval's results table (and its groups' table), as `lm_eval run` prints them."""
    from lm_eval.utils import make_table

    return make_table(results) + (f"\n{make_table(results, 'groups')}" if "groups" in results else "")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titanlite.eval", description=__doc__.split("\n\n")[1])
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument(
        "--model_args",
        default="",
        help="hf_assets_path=F, or config_file=X.toml,checkpoint=STEP, plus section.key=value overrides",
    )
    parser.add_argument("--include_path", default=None, help="folder of extra task YAML files")
    parser.add_argument(
        "--limit", type=float, default=None, help="at most this many examples per task (a fraction below 1)"
    )
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples in each prompt")
    parser.add_argument("--output_path", default=None, help="folder for lm-eval's results JSON (and samples)")
    parser.add_argument("--log_samples", action="store_true", help="also write every example's inputs and outputs")
    parser.add_argument("--batch_size", default="1", help="sequences per forward")
    args = parser.parse_args(argv)
    if args.log_samples and not args.output_path:
        raise UserError("--log_samples writes the samples under --output_path; set --output_path")
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not args.tasks:
        raise UserError(
            "--tasks names no task; give comma-separated lm-eval task or group names, e.g. --tasks hellaswag,arc_easy"
        )
    if args.limit is not None and not math.isfinite(args.limit):
        raise UserError(
            f"--limit {args.limit:g} is no number of examples; give a count of at least 1, a fraction "
            "between 0 and 1, or leave it out for every example"
        )
    if args.limit is not None and not args.limit > 0:
        raise UserError(
            f"--limit {args.limit:g} leaves no examples to evaluate; give a count of at least 1, a fraction "
            "between 0 and 1, or leave it out for every example"
        )
    if not args.batch_size.isdigit() or int(args.batch_size) < 1:
        raise UserError(
            f"--batch_size {args.batch_size}: titanlite takes a number of sequences per forward of at least 1"
        )
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num_fewshot {args.num_fewshot} is negative; give 0 or more examples, or leave it out")
    if args.output_path:
        check_writable(Path(args.output_path))
    return args


def check_writable(output_path: Path) -> None:
    """--output_path's folder (its parent for a .json file, as lm-eval reads it) exists or is made, and takes a file."""
    folder = output_path.parent if output_path.suffix == ".json" else output_path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise UserError(
            f"--output_path {output_path} cannot be written ({error.strerror or error}); point it at a writable folder"
        ) from None


def evaluate(argv: list[str]) -> None:
    args = parse_args(argv)
    init_logger(int(os.environ.get("RANK", 0)))  # under torchrun, rank 0's log alone says more than warnings
    tasks = args.tasks
    cfg = evaluation_config(args.model_args)
    task_manager(tuple(tasks), args.include_path)  # a bad task stops the run before the model is built
    try:
        info = init_distributed(cfg.job.device, cfg.job.init_timeout_seconds)
        results = evaluate_model(
            build_inference_model(cfg, info, "--model_args checkpoint"),
            tasks,
            args.include_path,
            batch_size=int(args.batch_size),
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            log_samples=args.log_samples,
        )
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
