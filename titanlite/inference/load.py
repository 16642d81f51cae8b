"""`titanlite.load(path)`: the model a folder holds, built in this process from the folder itself.

    a Hugging Face folder (config.json)   its family and dimensions from config.json, its tokenizer and chat template,
                                          its safetensors weights
    a checkpoint step-N folder of a run   the run's [model] section (its config.toml two folders up), that step's
                                          weights (under LoRA the base first, as training loads it)
    a run's dump folder (config.toml)     the same, with the weights of its newest complete checkpoint, as a resume
                                          takes them

No flags are parsed and no process group or device mesh is opened: one process runs no collective, so the model is
the plain module on one device (what build.py's 1-process layout is: FSDP shards over more than one rank only),
its weights through the one checked loader (checkpoint/weights.py: checksums, shapes and family). Sharded
generation and evaluation run under torchrun through python -m titanlite.generate and titanlite.eval.
"""

import dataclasses
import json
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.checkpoint.state import ModelState
from titanlite.checkpoint.weights import ModelIdentity, load_trained_weights, load_weights
from titanlite.config import load_config
from titanlite.config_sections import Checkpoint, LoRA, Model
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.inference.api import LM
from titanlite.log import logger
from titanlite.models import get_model_spec
from titanlite.models.construct import materialize, meta_model, model_args
from titanlite.models.hf_folder import check_files, read_model_folder
from titanlite.run import model_label

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16"}
UNVERIFIED_ADVICE = (
    "set checkpoint.allow_unverified true"  # checkpoint/integrity.py's advice, which load() words its way
)


def weights_dtype(path: Path) -> str:
    """The dtype of a Hugging Face folder's first floating-point safetensors weight, as training.param_dtype names it
    (float16 weights are held in float32)."""
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__" and entry["dtype"] in ("F32", "BF16", "F16"):
                return SAFETENSORS_DTYPES.get(entry["dtype"], "float32")
    return "float32"


def dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UserError(
            f"dtype={dtype!r}: titanlite holds weights in float32 or bfloat16; give torch.float32, "
            "torch.bfloat16, or None for the weights' own"
        )
    return name


def resolved_device(device) -> torch.device:
    """None or "auto": CUDA where a GPU is visible, else the CPU; else the device named."""
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(
            f'device={device!r}: give "cpu", "cuda", "cuda:N", a torch.device, or None for a GPU where one is visible'
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f'device={device!r}, but this process sees no GPU; give device="cpu"')
    if resolved.type not in ("cpu", "cuda"):
        raise UserError(f'device={device!r}: titanlite generates on "cpu" or "cuda"')
    return resolved


def whole_model(spec, args, param_dtype: str, lora: LoRA, device: torch.device):
    """The model on `device`, unsharded, initialised (its weights are loaded next)."""
    return materialize(meta_model(spec, args, param_dtype, lora), 0, device, tp_enabled=False)


def from_hf_folder(path: Path, dtype: str | None, device: torch.device, compile: bool) -> LM:
    folder = read_model_folder(path)
    cfg = Model(name=folder.spec.name, flavor=folder.flavor, hf_assets_path=str(path))
    check_files(cfg, Checkpoint(), path)
    tokenizer = build_tokenizer(cfg)
    args = model_args(cfg, folder.spec, tokenizer.vocab_size)
    model = whole_model(folder.spec, args, dtype or weights_dtype(path), LoRA(), device)
    identity = ModelIdentity(model_label(cfg), folder.spec.hf_adapter, args)
    load_weights(ModelState(model, False), path, identity, "titanlite.load's path")
    return LM(model.eval(), args, tokenizer, device, compile=compile)


def from_run(
    config_file: Path,
    step: Path | None,
    dtype: str | None,
    device: torch.device,
    *,
    compile: bool,
    allow_unverified: bool,
) -> LM:
    """A run's model (its config.toml), the weights of `step` or, where None, of its newest complete checkpoint."""
    cfg = load_config(["--job.config_file", str(config_file)])
    spec, tokenizer = get_model_spec(cfg.model.name), build_tokenizer(cfg.model)
    args = model_args(cfg.model, spec, tokenizer.vocab_size)
    model = whole_model(spec, args, dtype or cfg.training.param_dtype, cfg.lora, device)
    checkpoint = dataclasses.replace(
        cfg.checkpoint, allow_unverified=allow_unverified or cfg.checkpoint.allow_unverified
    )
    identity = ModelIdentity(model_label(cfg.model), spec.hf_adapter, args)
    try:
        source = load_trained_weights(
            model, identity, checkpoint, str(config_file.parent), step, "titanlite.load's path"
        )
    except UserError as error:
        if UNVERIFIED_ADVICE not in str(error):
            raise
        raise UserError(str(error).replace(UNVERIFIED_ADVICE, "pass allow_unverified=True to titanlite.load")) from None
    logger.info(f"loaded {model_label(cfg.model)} from {source}")
    return LM(model.eval(), args, tokenizer, device, chat_template=cfg.training.chat_template, compile=compile)


def load(path, device=None, dtype=None, compile: bool = False, allow_unverified: bool = False) -> LM:
    """The model at `path` (the module docstring), ready to generate. device: None = CUDA where a GPU is visible, else
    the CPU; dtype: torch.float32 or torch.bfloat16, None = the weights' own (a run's training.param_dtype);
    compile: torch.compile the token step (on CUDA also captured as a CUDA graph); allow_unverified: load a
    checkpoint that has no checksums folder."""
    path, name, where = Path(path).expanduser(), dtype_name(dtype), resolved_device(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise UserError(
            f"titanlite.load runs in one process, but this one is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}; generate on several ranks with torchrun ... -m titanlite.generate"
        )
    if (path / "config.json").is_file():
        return from_hf_folder(path, name, where, compile)
    if path.name.startswith("step-") and (path.parent.parent / "config.toml").is_file():
        return from_run(
            path.parent.parent / "config.toml", path, name, where, compile=compile, allow_unverified=allow_unverified
        )
    if (path / "config.toml").is_file():
        return from_run(path / "config.toml", None, name, where, compile=compile, allow_unverified=allow_unverified)
    raise UserError(
        f"titanlite.load({str(path)!r}): that is neither a Hugging Face model folder (config.json), a "
        "checkpoint step-N folder of a run nor a run's dump folder (config.toml); give one of those"
    )
