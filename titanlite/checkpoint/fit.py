"""Which checkpoint a run loads, and does it fit the model (one sentence naming the folder and the mismatch
if not); the RNG states it restores."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titanlite.checkpoint.folders import step_folder
from titanlite.errors import UserError
from titanlite.log import logger

# Top-level keys of a titanlite checkpoint besides the model's own tensors, which sit at the top
# level (as in torchtitan), so a model-only checkpoint is just the model's FQNs.
TRAINING_STATE = ("optimizer", "outer_optimizer", "lr_scheduler", "train_state", "dataloader", "rng")


def read_metadata(path: Path) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # unpickling garbage raises anything
        raise UserError(
            f"checkpoint {path} is corrupt: its .metadata cannot be read ({type(error).__name__}); delete the folder"
        ) from None


def load_in_place(path: Path, state: dict) -> dict:
    """dcp.load into `state`'s tensors (non-tensor values are replaced); a file DCP cannot read
    becomes one sentence naming the folder and the first rank's error."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        if isinstance(error, CheckpointException) and error.failures:
            error = next(iter(error.failures.values()))[0]
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0].split('. ')[0][:160]}" if lines else type(error).__name__
        raise UserError(
            f"checkpoint {path} cannot be loaded ({reason}); it is damaged: delete it or set checkpoint.load_step"
        ) from None
    return state


def is_training_key(fqn: str) -> bool:
    return fqn.split(".", 1)[0] in TRAINING_STATE


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {
        fqn: meta
        for fqn, meta in metadata.state_dict_metadata.items()
        if not is_training_key(fqn) and isinstance(meta, TensorStorageMetadata)
    }


def holds_training_state(metadata: Metadata) -> bool:
    return any(fqn.startswith("optimizer.") for fqn in metadata.state_dict_metadata)


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) or "a scalar"


def check_model_fits(
    metadata: Metadata, expected: dict[str, tuple], path: Path, model_name: str, saved_from: str = ""
) -> None:
    """`expected`: FQN -> global shape of this run's model."""
    saved = {fqn: tuple(meta.size) for fqn, meta in model_tensors(metadata).items()}
    origin = f" (it was saved from {saved_from})" if saved_from and saved_from != model_name else ""
    prefix = f"checkpoint {path} does not fit {model_name}{origin}:"
    missing = [fqn for fqn in expected if fqn not in saved]
    if missing:
        more = f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""
        raise UserError(
            f"{prefix} it lacks {missing[0]}{more}; point it at a checkpoint of this model family and flavor"
        )
    extra = [fqn for fqn in saved if fqn not in expected]
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise UserError(
            f"{prefix} it holds {extra[0]}{more}, which this model lacks; check model.name and model.flavor"
        )
    for fqn, shape in expected.items():
        if saved[fqn] != tuple(shape):
            raise UserError(
                f"{prefix} {fqn} is {_shape(saved[fqn])} there but {_shape(shape)} here; check model.name, "
                "model.flavor and the tokenizer"
            )


def choose_load_step(root: Path, complete: list[int], load_step: int) -> int:
    """checkpoint.load_step, which must be one of the complete checkpoints."""
    if load_step not in complete:
        found = ", ".join(map(str, complete)) or "none"
        raise UserError(
            f"checkpoint.load_step {load_step}: there is no complete checkpoint {step_folder(root, load_step)} "
            f"(complete steps: {found})"
        )
    return load_step


def newest_resumable(root: Path, complete: list[int]) -> int | None:
    """The newest checkpoint that holds training state (a model-only export is used only when nothing else is there)."""
    for step in reversed(complete):
        if holds_training_state(read_metadata(step_folder(root, step))):
            if step != complete[-1]:
                logger.info(f"step-{complete[-1]} holds the model only (a final export); resuming from step-{step}")
            return step
    return complete[-1] if complete else None


def rng_state() -> dict:
    """This rank's RNG states, which a resume on the same ranks restores (set_rng_state)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
