"""The one way weights enter a model: a resume, an initial load, generation and evaluation, DPO's reference and a
fault-tolerance peer all pass the same checks before a tensor is copied.

- A DCP step folder: every file against the checksum recorded at save (integrity.py), every tensor's shape against
  the model (fit.py; under LoRA the adapters against lora.rank and lora.target_modules), and the model it was saved
  from (its train state's label) against this one.
- A Hugging Face folder: its config.json's architecture against this family, its shape-defining values and every
  tensor's shape against the model (hf_io.py).

Another family with equal shapes (a Mistral checkpoint under a Llama config) is refused everywhere but in a new
training run's initial load with checkpoint.initial_load_model_only, where starting one model from another's
weights is what was asked (a warning names it). Another flavor of the same family is a warning.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from titanlite.checkpoint.fit import check_model_fits, choose_load_step, load_in_place, model_tensors, read_metadata
from titanlite.checkpoint.folders import METADATA, is_complete, list_steps, step_folder
from titanlite.checkpoint.hf_io import HFReader, load_model_from_hf
from titanlite.checkpoint.integrity import verify_checksums
from titanlite.checkpoint.lora import check_adapters_fit, check_not_adapters_only
from titanlite.checkpoint.state import ModelState
from titanlite.config_sections import Checkpoint
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.lora import has_lora


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint must have been saved from to load into this model."""

    label: str  # build.model_label: "family/flavor", a depth override included
    hf_adapter: object  # the family's Hugging Face names and config (None: the family has no HF form)
    args: object  # the model's args: the shapes an HF folder must have

    @property
    def family(self) -> str:
        return family_of(self.label)


def family_of(label: str) -> str:
    return label.split("/", 1)[0]


def saved_from(path: Path, metadata: Metadata) -> str:
    """The label of the model a checkpoint was saved from ("" for a checkpoint without a train state)."""
    if "train_state.model" not in metadata.state_dict_metadata:
        return ""
    return load_in_place(path, {"train_state": {"model": ""}})["train_state"]["model"]


def model_shapes(model: ModelState) -> dict[str, tuple]:
    """FQN -> global shape over every rank's share (pipeline stages each hold a part of the model); a process
    without a group (titanlite.load) holds the whole model."""
    if not dist.is_initialized():
        return {fqn: tuple(t.shape) for fqn, t in model.target(None).items()}
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, {fqn: tuple(t.shape) for fqn, t in model.target(None).items()})
    return {fqn: shape for share in shares for fqn, shape in share.items()}


def check_dcp_checkpoint(
    path: Path,
    model: ModelState,
    identity: ModelIdentity,
    key: str,
    *,
    resume: bool = False,
    transplant: bool = False,
    allow_unverified: bool = False,
) -> Metadata:
    """A DCP step folder's files, shapes and model, checked before anything is read into `model`; returns its
    metadata. `resume`: the run goes on, so the checkpoint must be of this very model; `transplant`: a new run
    starting from another model's weights (checkpoint.initial_load_model_only) is warned about, not refused;
    `allow_unverified` (checkpoint.allow_unverified): a checkpoint without checksum records loads, with a warning."""
    if not is_complete(path):
        raise UserError(
            f"{key} {path} is not a complete DCP checkpoint (no {METADATA} in it); point it at a step-N "
            "folder of a run's checkpoint folder"
        )
    verify_checksums(path, allow_unverified)
    metadata = read_metadata(path)
    origin = saved_from(path, metadata)
    shapes = model_shapes(model)
    saved = {fqn: tuple(m.size) for fqn, m in model_tensors(metadata).items()}
    if model.adapters_only and model.kind == "run":
        check_adapters_fit(saved, shapes, path)
    if not model.adapters_only:
        check_not_adapters_only(saved, path)
    check_model_fits(metadata, shapes, path, identity.label, origin)
    if origin and origin != identity.label:
        check_same_model(origin, identity.label, path, key, resume, transplant)
    return metadata


def check_same_model(origin: str, label: str, path: Path, key: str, resume: bool, transplant: bool) -> None:
    """Equal shapes, another model: refused where the weights would be taken for this model's own."""
    if resume:
        raise UserError(
            f"checkpoint {path} was saved from {origin}, but this run is {label}; set model.name and model.flavor to "
            f"{origin}, or start the new model from those weights with checkpoint.initial_load_path {path} and "
            "checkpoint.initial_load_model_only true in another job.dump_folder"
        )
    if family_of(origin) != family_of(label) and not transplant:
        raise UserError(
            f"{key} {path} holds the weights of {origin}, another model family than this job's {label}; set "
            f"model.name and model.flavor to {origin}'s, or point {key} at a checkpoint of {label}"
        )
    logger.warning(f"loading the weights of {origin} from {path} into {label}")


def check_peer_model(origin: str, label: str) -> None:
    """A fault-tolerance peer's live state (no files: nothing to checksum) is taken only from the same model, as a
    resume takes only its own model's checkpoint."""
    if origin != label:
        raise UserError(
            f"a live peer replica group trains {origin}, but this group is {label}; start every replica group "
            "with the same [model] section (and the same model.n_layers)"
        )


def check_hf_family(path: Path, identity: ModelIdentity, key: str) -> None:
    """A Hugging Face folder of another architecture with equal shapes is another model: refused by name."""
    config = HFReader(path).config
    theirs = config.get("architectures") or []
    ours = identity.hf_adapter.architectures
    if (theirs and not set(theirs) & set(ours)) or (
        not theirs and config.get("model_type") != identity.hf_adapter.model_type
    ):
        what = ", ".join(theirs) or f"model_type {config.get('model_type')!r}"
        raise UserError(
            f"{key} {path} holds a {what} model, not {identity.family} ({', '.join(ours)}); point {key} at a "
            f"Hugging Face folder of {identity.family}, or set model.name to the folder's family"
        )


def load_hf_weights(model: ModelState, path: Path, identity: ModelIdentity, key: str) -> None:
    if identity.hf_adapter is None:
        raise UserError(
            f"{key} {path} is a Hugging Face folder, but {identity.family} has no Hugging Face form; "
            "point it at a DCP step folder"
        )
    check_hf_family(path, identity, key)
    load_model_from_hf(model.target(None), path, identity.hf_adapter, identity.args, identity.label)


def load_weights(
    model: ModelState,
    path: Path,
    identity: ModelIdentity,
    key: str,
    *,
    transplant: bool = False,
    allow_unverified: bool = False,
) -> None:
    """Only the model's weights, from a Hugging Face folder (config.json) or a DCP step folder, checked, in place."""
    started = time.perf_counter()
    if (path / "config.json").is_file():
        load_hf_weights(model, path, identity, key)
        logger.info(f"loaded the model from the Hugging Face folder {path} in {time.perf_counter() - started:.2f}s")
        return
    check_dcp_checkpoint(path, model, identity, key, transplant=transplant, allow_unverified=allow_unverified)
    model.restore(load_in_place(path, model.target(None)))  # the model's FQNs are the checkpoint's top-level keys
    logger.info(f"loaded the model (weights only) from {path} in {time.perf_counter() - started:.2f}s")


def load_trained_weights(
    model: nn.Module, identity: ModelIdentity, cfg: Checkpoint, dump_folder: str, folder: Path | None, key: str
) -> str:
    """A trained model's weights for generation and evaluation, from the step folder `folder` (named by `key`), else
    from the checkpoint the run's checkpoint folder holds (checkpoint.load_step, else its newest complete step, a final
    model-only export too; rewinding nothing), else from those a new run starts from (checkpoint.initial_load_path).
    Under LoRA the base comes first: a step folder holds only the adapters. Returns where the weights came from."""
    root = Path(dump_folder) / cfg.folder
    if folder is None and cfg.enable and root.is_dir():
        complete, _ = list_steps(root)
        if cfg.load_step != -1:
            folder = step_folder(root, choose_load_step(root, complete, cfg.load_step))
        elif complete:
            folder = step_folder(root, complete[-1])
    if folder is None and not cfg.initial_load_path:
        raise UserError(
            f"there are no weights to load: set {key} to a step folder, model.hf_assets_path to a Hugging Face "
            "model folder, or checkpoint.enable true with the run's job.dump_folder"
        )
    adapters_only = has_lora(model)
    if folder is None or adapters_only:
        base = ModelState(model, adapters_only, "base")
        load_weights(
            base,
            Path(cfg.initial_load_path),
            identity,
            "checkpoint.initial_load_path",
            transplant=True,
            allow_unverified=cfg.allow_unverified,
        )
    if folder is not None:
        load_weights(
            ModelState(model, adapters_only, "run"), folder, identity, key, allow_unverified=cfg.allow_unverified
        )
    return str(folder or cfg.initial_load_path)
