"""Reward functions named in the config, loaded once and called on every rollout batch, as TRL 1.16 calls them.

rl.reward_functions lists specs: `path/to/file.py:function` (a file, by its path from the working directory) or
`module:function` (an importable module, e.g. titanlite.rewards:math_answer). Each is loaded on every rank at the
start of the run; a mistake in a spec, or a function that misbehaves mid-run, stops the run in one sentence that
names it.

score() is TRL's reward arithmetic (GRPOTrainer._calculate_rewards and the sum in _generate_and_score_completions):
a None reward becomes NaN in the [completions, functions] table, the total is the NaN-skipping sum of weight x
reward, and a completion every function returned None for is unscorable: its total is NaN (TRL leaves it out of
its group's mean and std and gives it advantage 0). Each function gets its own copies of the arguments (TRL builds
its tensors before it calls the rewards, so a function editing its lists in place is harmless there too).
"""

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titanlite.errors import UserError

# The arguments every reward function receives besides the record's fields; a field may not share a name with them.
RESERVED = ("prompts", "completions", "completion_ids")
LIVE = ("environments",)  # arguments passed as they are, not copied (objects with state, as TRL passes them)


@dataclass(frozen=True)
class RewardFunction:
    spec: str  # as written in the config: path/to/file.py:function or module:function
    name: str  # the function's name in the spec: rl/reward/<name> in TensorBoard, the key in rollouts.jsonl
    function: Callable


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def load_file(path: Path, spec: str, key: str):
    """The module of a reward file, imported by its path under a name of its own (so two files named rewards.py
    do not collide); importing the same file twice gives the same module."""
    if not path.is_file():
        raise UserError(
            f"{key} entry {spec!r} names the file {path}, which does not exist (paths are relative to the "
            f"working directory {Path.cwd()}); fix the path"
        )
    resolved = path.resolve()
    name = f"titanlite_reward_file_{resolved.stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it, as an import does (dataclasses and pickling look it up)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UserError(f"{key} entry {spec!r}: importing {path} failed ({first_line(error)}); fix the file") from None
    return module


def load_module(module_name: str, spec: str, key: str):
    try:
        return importlib.import_module(module_name)
    except Exception as error:
        raise UserError(
            f"{key} entry {spec!r}: importing the module {module_name} failed ({first_line(error)}); fix the "
            "module name (or write path/to/file.py:function for a file), or install what it needs"
        ) from None


def load_attribute(spec: str, key: str) -> tuple[str, object]:
    """(the name, the object) that a `path/to/file.py:name` or `module:name` spec names (rl.tools and
    rl.environment load theirs with it too)."""
    where, colon, attribute = spec.rpartition(":")
    if not colon or not where or not attribute:
        raise UserError(
            f"{key} entry {spec!r} is not path/to/file.py:function or module:function; write the file or "
            "module, a colon, and the function's name"
        )
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = load_file(Path(where), spec, key) if is_file else load_module(where, spec, key)
    if not hasattr(module, attribute):
        raise UserError(f"{key} entry {spec!r}: {where} has no attribute {attribute!r}; name a function it defines")
    return attribute, getattr(module, attribute)


def load_reward_function(spec: str, key: str) -> RewardFunction:
    attribute, function = load_attribute(spec, key)
    if not callable(function) or isinstance(function, type):
        raise UserError(
            f"{key} entry {spec!r} names a {type(function).__name__}, not a function; name a reward "
            "function (prompts, completions, completion_ids, **fields) -> list of floats"
        )
    return RewardFunction(spec=spec, name=attribute, function=function)


def load_reward_functions(specs: Sequence[str], key: str = "rl.reward_functions") -> list[RewardFunction]:
    """The functions the specs name, in order; every spec is checked before any runs."""
    if not specs:
        raise UserError(f"{key} is empty; name at least one reward function, e.g. titanlite.rewards:math_answer")
    functions = [load_reward_function(spec, key) for spec in specs]
    names = [function.name for function in functions]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        clashing = " and ".join(function.spec for function in functions if function.name == twice)
        raise UserError(
            f"{key} names two functions {twice!r} ({clashing}); rewards are logged by function name, so "
            "give one another name (or list it once)"
        )
    return functions


def reward_weights(weights: Sequence[float], count: int, key: str = "rl.reward_weights") -> torch.Tensor:
    """The weight of each reward function as a float32 tensor: all 1.0 where none are given (TRL's default)."""
    if not weights:
        return torch.ones(count, dtype=torch.float32)
    if len(weights) != count:
        raise UserError(
            f"{key} has {len(weights)} weights for {count} reward functions; give one weight per function "
            "in rl.reward_functions, in the same order (or none: all 1.0)"
        )
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
        raise UserError(f"{key} = {list(weights)} holds a value that is not a finite number; give numbers")
    return torch.tensor([float(w) for w in weights], dtype=torch.float32)


def checked_rewards(output, function: RewardFunction, count: int) -> list[float]:
    """A function's output as floats, None as NaN (as TRL converts it); anything else stops the run, naming it. A list
    or tuple of numbers is what TRL's functions return; a 1-D numpy array or tensor is accepted too."""
    listed = isinstance(output, (list, tuple)) or hasattr(output, "__array__") and getattr(output, "ndim", 0) == 1
    if not listed:
        raise UserError(
            f"reward function {function.spec} returned a {type(output).__name__}, not a list of one reward "
            "per completion; return a list of floats (None where it does not apply)"
        )
    if len(output) != count:
        raise UserError(
            f"reward function {function.spec} returned {len(output)} rewards for {count} completions; "
            "return one per completion, in order (None where it does not apply)"
        )
    rewards = []
    for index, value in enumerate(output):
        if isinstance(value, np.generic) or isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()  # numpy's and torch's scalars (a numpy bool is no numbers.Real) as Python's
        value = math.nan if value is None else value
        if not isinstance(value, numbers.Real):
            raise UserError(
                f"reward function {function.spec} returned {value!r:.60} (a {type(value).__name__}) for "
                f"completion {index}; a reward is a number, or None where the function does not apply"
            )
        if math.isinf(value):
            raise UserError(
                f"reward function {function.spec} returned {value} for completion {index}; a reward is "
                "finite (None where the function does not apply)"
            )
        rewards.append(float(value))
    return rewards


def call(function: RewardFunction, prompts: list, completions: list, completion_ids: list, fields: dict) -> list[float]:
    """The function's rewards. It gets copies of its arguments: one that edits them (pops a trailing eos from
    completion_ids, say) changes neither the rows that are trained and logged nor what the next function sees."""
    live = {name: fields[name] for name in LIVE if name in fields}  # rl.environment's instances, as TRL passes them
    prompts, completions, fields = copy.deepcopy(
        (prompts, completions, {k: v for k, v in fields.items() if k not in live})
    )
    fields |= live
    completion_ids = [list(ids) for ids in completion_ids]  # lists of ints: a copy of each list is a deep copy
    try:
        output = function.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        if inspect.isawaitable(output):  # an async function (an LLM judge, say), as TRL allows
            output = asyncio.run(output)
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"reward function {function.spec} raised {first_line(error)}; fix the function") from None
    return checked_rewards(output, function, len(completions))


def score(
    functions: Sequence[RewardFunction],
    weights: torch.Tensor,
    prompts: list,
    completions: list,
    completion_ids: list,
    fields: dict[str, list],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each function's rewards [completions, functions], float32 with NaN for None; the total [completions]: the
    weighted sum over the functions that scored the completion, NaN where none did)."""
    clash = next((name for name in RESERVED if name in fields), None)
    if clash is not None:
        raise UserError(
            f"the prompt records have a field named {clash!r}, which reward functions receive as an argument "
            "of their own; rename the field"
        )
    per_function = torch.empty(len(completions), len(functions), dtype=torch.float32)
    for column, function in enumerate(functions):
        per_function[:, column] = torch.tensor(call(function, prompts, completions, completion_ids, fields))
    total = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    total[per_function.isnan().all(dim=1)] = math.nan  # unscorable: nansum's 0 would bias its group's baseline
    return per_function, total
