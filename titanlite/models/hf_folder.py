"""Start a run from a Hugging Face model folder: model.hf_assets_path naming config.json + safetensors + tokenizer
files is all a job has to name.

The family comes from config.json's architectures (or model_type), every dimension from the rest of it, through
the family adapter's args_from_hf_config (the inverse of hf_config). Where the dimensions are a registered
flavor's (the folder's vocabulary filling a flavor that takes the tokenizer's), the run is named by it
(llama3/8B); otherwise by FOLDER_FLAVOR (llama3/hf). The weights come through checkpoint.initial_load_in_hf
(checkpoint/hf_io.py reads them a tensor at a time, each rank keeping only its shard), the tokenizer from the
same folder (data/tokenizer.py). A folder with no config.json stays what it was before: a tokenizer folder.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanlite.config_sections import Checkpoint, Model
from titanlite.errors import UserError
from titanlite.models import ModelSpec, list_model_specs

FOLDER_FLAVOR = "hf"  # model.flavor of a folder whose dimensions are no registered flavor's
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    spec: ModelSpec
    flavor: str  # a registered flavor with exactly these args, or FOLDER_FLAVOR
    args: Any


def is_model_folder(path: str | Path) -> bool:
    return bool(str(path)) and (Path(path) / "config.json").is_file()


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(
            f"cannot read {path / 'config.json'} ({error}); fix the file or set model.hf_assets_path to another folder"
        ) from None
    if not isinstance(config, dict):
        raise UserError(
            f"{path / 'config.json'} is not a JSON object; set model.hf_assets_path to a Hugging Face model folder"
        )
    check_value_types(config, path / "config.json")
    return config


# config.json's keys that hold a number, of every family titanlite reads (null is allowed: "not set").
NUMBER_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "head_dim",
    "sliding_window",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "layer_norm_epsilon",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_nextn_predict_layers",
    "router_aux_loss_coef",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


# config.json's keys titanlite reads that hold text, a list of text or an object (null: "not set").
KIND_KEYS = {
    "model_type": (str, "text"),
    "architectures": (list, "a list of class names"),
    "rope_scaling": (dict, "an object"),
    "rope_parameters": (dict, "an object"),
}


def check_value_types(config: dict, path: Path) -> None:
    """A number written as text ("hidden_size": "256"), or a key of another kind ("architectures": 7), is one
    sentence naming the key, before anything reads it."""
    for key, (kind, described) in KIND_KEYS.items():
        value = config.get(key)
        if value is not None and not (
            isinstance(value, kind) and (kind is not list or all(isinstance(v, str) for v in value))
        ):
            raise UserError(f'{path}: "{key}" is {json.dumps(value)}, which is not {described}; fix the file')
    for key in NUMBER_KEYS:
        value = config.get(key)
        ids = isinstance(value, list) and key.endswith("_token_id")  # eos may be a list of ids
        numbers = value if ids else [value]
        if value is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise UserError(
                f'{path}: "{key}" is {json.dumps(value)}, which is not a number; write it as a JSON number '
                f"(without quotes) or fix the file"
            )


def families_of(config: dict, path: Path) -> list[ModelSpec]:
    """The registered families whose adapter reads this architecture (llama3 and llama2 share Llama's)."""
    architectures = config.get("architectures") or []
    specs = [s for s in list_model_specs() if s.hf_adapter is not None]
    found = [s for s in specs if set(architectures) & set(s.hf_adapter.architectures)]
    if not found and not architectures:
        found = [s for s in specs if s.hf_adapter.model_type == config.get("model_type")]
    if not found:
        what = ", ".join(architectures) or f"model_type {config.get('model_type')!r}"
        supported = sorted({a for s in specs for a in s.hf_adapter.architectures})
        raise UserError(
            f"model.hf_assets_path {path} holds a {what} model, which titanlite cannot train; supported "
            f"architectures: {', '.join(supported)}"
        )
    return found


def with_vocab(flavor_args, vocab_size: int):
    """A flavor's args, its vocabulary the folder's where the flavor takes the tokenizer's (-1)."""
    return dataclasses.replace(flavor_args, vocab_size=vocab_size) if flavor_args.vocab_size == -1 else flavor_args


def matching_flavor(spec: ModelSpec, args) -> tuple[str, Any]:
    """(flavor, its args) when a registered flavor of `spec` describes the same model as config.json does."""
    adapter = spec.hf_adapter
    ours = adapter.hf_config(args)
    for flavor, flavor_args in spec.flavors.items():
        flavor_args = with_vocab(flavor_args, args.vocab_size)
        if adapter.hf_config(flavor_args) == ours:
            return flavor, flavor_args
    return FOLDER_FLAVOR, args


def read_model_folder(path: str | Path, name: str | None = None) -> ModelFolder:
    """The family, flavor and args of the model in a Hugging Face folder; `name` (model.name as the job set it)
    must be one of the families that read its architecture."""
    path = Path(path)
    config = read_config(path)
    families = families_of(config, path)
    adapter = families[0].hf_adapter
    try:
        args = adapter.args_from_hf_config(config)
        problem = adapter.unsupported_setting(config, args)
    except UserError as error:
        problem = str(error)
    if problem:
        raise UserError(f"model.hf_assets_path {path} holds a model titanlite cannot train as it is: {problem}")
    if name is not None and name not in [s.name for s in families]:
        raise UserError(
            f"model.name {name} contradicts model.hf_assets_path {path}, whose config.json is a "
            f"{adapter.architectures[0]} ({' or '.join(s.name for s in families)} here); remove model.name, "
            "the folder names the family"
        )
    candidates = [s for s in families if s.name == name] if name else families
    for spec in candidates:  # a registered flavor names the run where one fits (llama2/7B rather than llama3/hf)
        flavor, flavor_args = matching_flavor(spec, args)
        if flavor != FOLDER_FLAVOR:
            return ModelFolder(path, spec, flavor, flavor_args)
    return ModelFolder(path, candidates[0], FOLDER_FLAVOR, args)


def first_difference(adapter, theirs, ours) -> str:
    """The first config.json value two args disagree on, as a phrase."""
    a, b = adapter.hf_config(theirs), adapter.hf_config(ours)
    key = next((k for k in a if a[k] != b.get(k)), "architectures")
    return f"{key} {a.get(key)} there, {b.get(key)} in the flavor"


def check_explicit_keys(model: Model, folder: ModelFolder, explicit: set[str]) -> None:
    """A [model] key the job set must say what the folder says."""
    where = f"model.hf_assets_path {folder.path}"
    if "model.flavor" in explicit and model.flavor not in (folder.flavor, FOLDER_FLAVOR):
        flavor_args = folder.spec.flavors.get(model.flavor)
        if flavor_args is None:
            reason = f"{folder.spec.name} has no such flavor"
        else:
            reason = first_difference(
                folder.spec.hf_adapter, folder.args, with_vocab(flavor_args, folder.args.vocab_size)
            )
        raise UserError(
            f"model.flavor {model.flavor} contradicts {where}, whose config.json fixes every dimension "
            f"({reason}); remove model.flavor"
        )
    if "model.n_layers" in explicit and model.n_layers not in (0, folder.args.n_layers):
        raise UserError(
            f"model.n_layers {model.n_layers} contradicts {where}, whose config.json has "
            f"{folder.args.n_layers} layers; remove model.n_layers"
        )


def check_files(model: Model, checkpoint: Checkpoint, path: Path) -> None:
    """The weights (unless the run starts from another checkpoint) and a tokenizer, before anything is built."""
    if not checkpoint.initial_load_path and not any((path / name).is_file() for name in WEIGHT_FILES):
        other = (
            " (only safetensors weights can be read; save them with transformers' save_pretrained)"
            if any(path.glob("*.bin"))
            else ""
        )
        raise UserError(
            f"model.hf_assets_path {path} holds no {' or '.join(WEIGHT_FILES)}{other}; add the model's "
            "weights or set checkpoint.initial_load_path to the checkpoint to start from"
        )
    if not model.tokenizer_path and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"model.hf_assets_path {path} holds no {' or '.join(TOKENIZER_FILES)}; copy the model's tokenizer "
            "files into it or set model.tokenizer_path"
        )


def start_from_folder(model: Model, checkpoint: Checkpoint, explicit: set[str]) -> None:
    """When model.hf_assets_path is a model folder: the job's model.name and model.flavor become the folder's,
    model.moe_aux_loss_coeff its config.json's router_aux_loss_coef (MoE folders), and checkpoint.initial_load_path
    (when the job left it empty) the folder, read in Hugging Face format.
    `explicit` holds the keys the job set (TOML or command line): those must agree with config.json."""
    if not is_model_folder(model.hf_assets_path):
        if model.hf_assets_path and any(Path(model.hf_assets_path).glob("*.safetensors")):
            raise UserError(
                f"model.hf_assets_path {model.hf_assets_path} holds safetensors weights but no config.json; "
                "add the model's config.json to the folder"
            )
        return  # a tokenizer folder, or none
    path = Path(model.hf_assets_path)
    folder = read_model_folder(path, model.name if "model.name" in explicit else None)
    check_explicit_keys(model, folder, explicit)
    check_files(model, checkpoint, path)
    model.name, model.flavor = folder.spec.name, folder.flavor
    coef = read_config(path).get("router_aux_loss_coef")
    if "model.moe_aux_loss_coeff" not in explicit and isinstance(coef, (int, float)) and not isinstance(coef, bool):
        model.moe_aux_loss_coeff = float(coef)  # the balance weight the model was trained with, unless the job sets one
    if not checkpoint.initial_load_path:
        checkpoint.initial_load_path, checkpoint.initial_load_in_hf = str(path), True
