"""lm-eval tasks run on a titanlite model: the task names and task files checked first (one sentence each,
where lm-eval itself would skip a file that does not parse and then call its task unknown), lm-eval's
simple_evaluate, its results JSON written by its EvaluationTracker, and the metrics as {task/metric: value}
scalars for TensorBoard. lm-eval is imported inside the functions that need it: only where evaluation runs."""

import functools
import logging
import math
import time
from pathlib import Path

import yaml

from titanlite.errors import UserError


class _AnyTagLoader(yaml.SafeLoader):
    """YAML as lm-eval's task files write it: their !function tags are only parsed here, never run."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def check_task_files(include_path: str | None) -> None:
    """Every *.yaml under include_path parses."""
    if include_path is None:
        return
    root = Path(include_path)
    if not root.is_dir():
        raise UserError(f"--include_path {root} is not a folder; point it at the folder holding the task YAML files")
    for path in sorted(root.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(), Loader=_AnyTagLoader)
        except (yaml.YAMLError, OSError, UnicodeDecodeError) as error:
            where = getattr(error, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise UserError(
                f"the task file {path} does not parse{line} ({getattr(error, 'problem', None) or error}); fix the YAML"
            ) from None


def unknown_task(task: str, include_path: str | None) -> UserError:
    where = f" or in --include_path {include_path}" if include_path else "; add --include_path for a local task"
    return UserError(
        f"unknown task {task!r}: lm-eval has no task or group of that name{where} "
        "(python -m lm_eval ls tasks lists them)"
    )


def lm_eval_task_texts() -> list[str]:
    """The text of every task file lm-eval ships: a name in none of them is no task of lm-eval's, which is
    found in seconds, where lm-eval's TaskManager takes about a minute to index them all."""
    import lm_eval.tasks

    return [path.read_text(errors="replace") for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml")]


@functools.cache
def task_manager(tasks: tuple[str, ...], include_path: str | None):
    """lm-eval's TaskManager for `tasks`, once every name is known to it: include_path's alone where it holds
    them all, else with lm-eval's own tasks."""
    from lm_eval.tasks import TaskManager

    check_task_files(include_path)
    local = set()
    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(manager.all_tasks):
            return manager
        local = set(manager.all_tasks)
    texts = lm_eval_task_texts()
    for task in tasks:
        if task not in local and not any(task in text for text in texts):
            raise unknown_task(task, include_path)
    manager = TaskManager(include_path=include_path)
    for task in tasks:
        if task not in manager.all_tasks:
            raise unknown_task(task, include_path)
    return manager


def evaluate_tasks(
    lm,
    tasks: list[str],
    include_path: str | None,
    *,
    limit: float | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    fewshot_key: str = "--num_fewshot",
) -> dict:
    """lm-eval's results dict for `tasks` run on `lm` (lm_eval_model.TitanliteLM); fewshot_key: how the caller names
    num_fewshot (the in-loop evaluator: eval.num_fewshot)."""
    from lm_eval import simple_evaluate

    manager = task_manager(tuple(tasks), include_path)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task progress lines would drown the run's log
    try:
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            batch_size=lm.batch_size,
        )
    except ValueError as error:  # raised while lm-eval builds the prompts, before any forward
        if "Sample larger than population" not in str(error):
            raise
        asked = f"{fewshot_key} {num_fewshot}" if num_fewshot is not None else "its own num_fewshot"
        raise UserError(
            f"a task of {', '.join(tasks)} has fewer examples to show than {asked} asks for; give a smaller "
            f"{fewshot_key}"
        ) from None


def write_results(results: dict, output_path: str, log_samples: bool, model_args: str) -> None:
    """lm-eval's results JSON (and each task's samples) under output_path/<the weights' path, sanitized>, as
    lm_eval run writes them; `model_args` the --model_args string."""
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import simple_parse_args_string

    samples = results.pop("samples", None) if log_samples else None
    results["config"].update(model="titanlite", model_args=model_args)
    named = simple_parse_args_string(model_args)
    weights = named.get("checkpoint") or named.get("hf_assets_path") or named.get("config_file") or "titanlite"
    tracker = EvaluationTracker(output_path=output_path)
    # The tracker times from its own creation; the evaluation began total_evaluation_time_seconds ago
    # (titanlite/eval.py).
    tracker.general_config_tracker.start_time = time.perf_counter() - float(
        results.get("total_evaluation_time_seconds", 0)
    )
    tracker.general_config_tracker.log_experiment_args(
        model_source="titanlite",
        model_args={"model": weights},
        system_instruction=None,
        chat_template=None,
        fewshot_as_multiturn=False,
    )
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])


def metric_scalars(results: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} of every task's metrics ("acc", "acc_norm", ...; lm-eval's ",none" filter
    suffix dropped, other filters kept after a slash), without the standard errors."""
    scalars = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric in ("alias", "sample_len") or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
            if not math.isnan(value):
                scalars[f"{task}/{name}"] = float(value)
    return scalars
