"""What python -m titanlite.eval does between its arguments and its exit: --model_args read as a titanlite job's
config, the tasks checked before the model is built, lm-eval's simple_evaluate on the InferenceModel (model.py),
its results JSON written as `lm_eval run` writes it, and its results table. lm-eval is imported inside the
functions: only where evaluation runs."""

import time

from titanlite.config import load_config
from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.inference.model import InferenceModel
from titanlite.inference.tasks import evaluate_tasks
from titanlite.log import logger

# --model_args keys that are not section.key overrides, and the config key each one sets.
MODEL_ARG_KEYS = {"hf_assets_path": "model.hf_assets_path", "config_file": "job.config_file",
                  "checkpoint": "generate.checkpoint"}


def config_argv(arg_dict: dict) -> list[str]:
    """--model_args (parsed by lm-eval) as titanlite.config command-line flags."""
    argv = []
    for key, value in arg_dict.items():
        dotted = MODEL_ARG_KEYS.get(key, key)
        if "." not in dotted:
            raise UserError(f"--model_args {key}={value}: titanlite takes {', '.join(MODEL_ARG_KEYS)} or section.key=value "
                            "overrides of its config (e.g. training.param_dtype=bfloat16)")
        argv += [f"--{dotted}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def evaluation_config(model_args: str) -> JobConfig:
    """The job config that --model_args names: hf_assets_path=F, or config_file=X.toml,checkpoint=STEP, plus
    section.key=value overrides."""
    from lm_eval.utils import simple_parse_args_string

    return load_config(config_argv(simple_parse_args_string(model_args)))


def evaluate_model(loaded: InferenceModel, tasks: list[str], include_path: str | None, *, batch_size: int,
                   limit: float | None = None, num_fewshot: int | None = None, log_samples: bool = False) -> dict | None:
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
