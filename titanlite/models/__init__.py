"""The model registry: every family and its flavors, found by the names in the [model] section.

A family lives in its own package, which defines `SPECS` (its ModelSpec objects); adding a family
is adding its package to _FAMILY_PACKAGES. The packages are imported on first lookup, so they can
import ModelSpec from here without an import cycle. Parallelism is applied from outside the model
(titanlite/parallel/parallelize.py); the one thing a family declares for it is its TP plan.
"""

import difflib
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from titanlite.errors import UserError

_FAMILY_PACKAGES = (
    "titanlite.models.llama",
    "titanlite.models.mistral",
    "titanlite.models.mixtral",
    "titanlite.models.qwen3",
    "titanlite.models.gpt2",
    "titanlite.models.deepseek_v3",
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type  # model_cls(args) -> nn.Module
    flavors: dict[str, Any]  # flavor name -> args dataclass instance
    # apply_tp(model, dims, loss_parallel, sequence_parallel=True): the family's tensor-parallel plan (parallel/tp.py
    # styles); sequence_parallel=False: the plan generation decodes with (decode_style)
    apply_tp: Callable
    flops_per_token: Callable  # flops_per_token(unsharded model, seq_len) -> float
    hf_adapter: Any = None  # a titanlite.models.hf.HFAdapter: Hugging Face names, layouts and config.json


@functools.cache
def _registry() -> dict[str, ModelSpec]:
    specs = [spec for package in _FAMILY_PACKAGES for spec in importlib.import_module(package).SPECS]
    return {spec.name: spec for spec in specs}


def _unknown_name_error(key: str, value: str, what: str, valid: list[str]) -> UserError:
    lowered = {name.lower(): name for name in valid}
    closest = difflib.get_close_matches(value.lower(), lowered, n=1, cutoff=0.0)
    hint = f"did you mean '{lowered[closest[0]]}'? " if closest else ""
    return UserError(f"{key} '{value}' is not {what}; {hint}valid: {', '.join(valid)}")


def list_model_specs() -> list[ModelSpec]:
    return list(_registry().values())


def get_model_spec(name: str) -> ModelSpec:
    registry = _registry()
    if name not in registry:
        raise _unknown_name_error("model.name", name, "a known model family", list(registry))
    return registry[name]


def get_model_args(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        raise _unknown_name_error("model.flavor", flavor, f"a flavor of {spec.name}", list(spec.flavors))
    return spec.flavors[flavor]
