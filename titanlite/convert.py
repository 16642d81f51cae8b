"""Convert model weights between titanlite's DCP checkpoints and Hugging Face folders.

    python -m titanlite.convert hf-to-dcp <hf_dir> <dcp_dir> --model.name llama3 --model.flavor 8B
    python -m titanlite.convert dcp-to-hf <dcp_dir> <hf_dir> --model.name llama3 --model.flavor 8B \\
        [--checkpoint.export_dtype bfloat16] [--max_shard_mb 5000]

The model flags (or --job.config_file) name the family and flavor, which fix every shape; a
flavor whose vocabulary comes from the tokenizer (debugmodel) takes it from the source instead.
dcp-to-hf reads the model from the checkpoint where the run recorded it (its family, flavor and shape
as config.json, so a run started from a Hugging Face folder exports too): flags are then not needed,
and flags naming another model are refused.
dcp-to-hf reads any titanlite checkpoint (full or model-only; only the model is converted) a
layer at a time and writes safetensors shards of at most --max_shard_mb, with
model.safetensors.index.json when there is more than one, plus config.json; it verifies the checkpoint's
checksums as a resume does (checkpoint.allow_unverified for one without them). Where the run's tokenizer is known
(the run's config.toml in the dump folder above the checkpoint, or --job.config_file, --model.hf_assets_path or
--model.tokenizer_path), the folder also gets what checkpoint.last_save_in_hf writes: the tokenizer files, the chat
template, config.json's bos and eos ids and generation_config.json (export_files.py); where it is not, the command
says what it left out and why. hf-to-dcp writes a model-only
DCP checkpoint with its checksums, usable as checkpoint.initial_load_path; it holds the model in memory.
The destination must be a new or empty folder: one holding files (a checkpoint of a run, above
all) is written over only with --overwrite.
"""

import dataclasses
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint.fit import check_model_fits, load_in_place, model_tensors, read_metadata
from titanlite.checkpoint.folders import METADATA, is_complete
from titanlite.checkpoint.hf_io import (
    DEFAULT_MAX_SHARD_BYTES,
    HFReader,
    copy_tokenizer,
    layer_groups,
    read_hf_tensors,
    write_hf_folder,
)
from titanlite.checkpoint.integrity import CHECKSUMS, record_checksums, verify_checksums
from titanlite.config import load_config
from titanlite.config_sections import JobConfig
from titanlite.data.tokenizer import build_tokenizer
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError, exit_code
from titanlite.models import get_model_args, get_model_spec
from titanlite.models.hf_folder import is_model_folder, read_model_folder

USAGE = """usage: python -m titanlite.convert {hf-to-dcp,dcp-to-hf} SOURCE DESTINATION
           [--model.name N] [--model.flavor F] [--job.config_file X.toml]
           [--checkpoint.export_dtype float32|bfloat16] [--max_shard_mb 5000] [--overwrite]"""
COMMANDS = ("hf-to-dcp", "dcp-to-hf")


def model_shapes(spec, args) -> dict[str, tuple]:
    """FQN -> shape of the model these args build, computed on the meta device."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def job_model_args(cfg, spec):
    """The model the flags or the job's config.toml name: its flavor, or the Hugging Face folder the run started from
    (model.hf_assets_path with a config.json, whose run's config.toml says model.flavor hf)."""
    if is_model_folder(cfg.model.hf_assets_path):
        return read_model_folder(cfg.model.hf_assets_path, cfg.model.name).args
    return get_model_args(spec, cfg.model.flavor)


def resolve_args(args, vocab_size: int | None, source: Path):
    if args.vocab_size == -1:
        if vocab_size is None:
            raise UserError(f"cannot tell the vocabulary size of {source}; use a flavor with a fixed vocabulary")
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def check_destination(destination: Path, overwrite: bool) -> None:
    """Never write over a checkpoint (or anything else) by accident."""
    if destination.exists() and not destination.is_dir():
        raise UserError(f"the destination {destination} is a file; give a folder")
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        what = "a complete DCP checkpoint" if is_complete(destination) else "files"
        raise UserError(
            f"the destination {destination} already holds {what}; choose a new folder, or add --overwrite to "
            "replace them"
        )


def recorded_model(source: Path, metadata) -> tuple[str, str]:
    """(the model label the run saved this checkpoint from, its config.json as text); "" for what is not recorded
    (a model-only export, or a checkpoint saved before the config was recorded)."""
    keys = metadata.state_dict_metadata
    wanted = {key: "" for key in ("model", "model_config") if f"train_state.{key}" in keys}
    recorded = load_in_place(source, {"train_state": wanted})["train_state"] if wanted else {}
    return recorded.get("model", ""), recorded.get("model_config", "")


def model_from_checkpoint(source: Path, metadata, named: str | None):
    """(spec, args, label) of the model the checkpoint was saved from, or None where it is not recorded;
    `named` ("family/flavor" when flags name a model) must agree."""
    label, config = recorded_model(source, metadata)
    if not label:
        return None
    if named is not None and named != label.split(" with ")[0]:
        raise UserError(
            f"{source} was saved from {label}, but the flags name {named}; drop --model.name and --model.flavor "
            "(dcp-to-hf reads the model from the checkpoint)"
        )
    family, flavor = label.split(" with ")[0].split("/", 1)
    spec = get_model_spec(family)
    if config:
        return spec, spec.hf_adapter.args_from_hf_config(json.loads(config)), label
    if flavor == "hf":
        raise UserError(
            f"{source} was saved from a run started from a Hugging Face folder before checkpoints recorded the "
            "model's config; export it with the run's checkpoint.last_save_in_hf, or resume the run once and save again"
        )
    args = get_model_args(spec, flavor)
    layers = re.search(r"with model.n_layers (\d+)", label)
    return spec, dataclasses.replace(args, n_layers=int(layers.group(1))) if layers else args, label


def dcp_to_hf(
    source: Path, destination: Path, spec, cfg, max_shard_bytes: int, overwrite: bool, named: bool = False
) -> None:
    """`cfg`: the job's config (the model's flavor or folder, checkpoint.export_dtype and allow_unverified); `named`:
    the
    flags name the model (else the checkpoint's record alone does)."""
    if not is_complete(source):
        raise UserError(f"{source} is not a complete DCP checkpoint: it has no {METADATA}")
    verify_checksums(
        source, cfg.checkpoint.allow_unverified
    )  # as a resume does: a file changed on disk is named, never exported
    flavor = cfg.model.flavor
    metadata = read_metadata(source)
    saved = model_tensors(metadata)
    embedding = saved.get("tok_embeddings.weight")
    recorded = model_from_checkpoint(source, metadata, f"{spec.name}/{flavor}" if named else None)
    if recorded:
        spec, args, model_name = recorded
        if args.vocab_size == -1 and embedding:
            args = dataclasses.replace(args, vocab_size=embedding.size[0])
    else:
        args = resolve_args(job_model_args(cfg, spec), embedding.size[0] if embedding else None, source)
        model_name = f"{spec.name}/{flavor}"
    shapes = model_shapes(spec, args)
    check_model_fits(metadata, shapes, source, model_name)
    check_destination(destination, overwrite)

    def layers():
        for group in layer_groups(shapes):
            state = {name: torch.empty(saved[name].size, dtype=saved[name].properties.dtype) for name in group}
            load_in_place(source, state)
            yield state

    write_hf_folder(layers(), destination, spec.hf_adapter, args, DTYPES[cfg.checkpoint.export_dtype], max_shard_bytes)


TOKENIZER_FLAGS = ("--job.config_file", "--model.hf_assets_path", "--model.tokenizer_path")
LEFT_OUT = "config.json and the weights only: no tokenizer files, chat template, generation_config.json or eos_token_id"


def run_config(source: Path, cfg: JobConfig, flags: list[str]) -> tuple[JobConfig | None, str]:
    """(the config that names the run's tokenizer, where it was found), or (None, why none was): the flags' where they
    name a config file or a tokenizer, else the run's resolved config.toml in the dump folder that holds the
    checkpoint (<dump_folder>/<checkpoint.folder>/step-N)."""
    if any(flag.split("=")[0] in TOKENIZER_FLAGS for flag in flags):
        return cfg, "the flags"
    for folder in source.resolve().parents[:4]:
        path = folder / "config.toml"
        if not path.is_file():
            continue
        try:
            found = load_config(["--job.config_file", str(path)])
        except UserError as error:
            return None, f"the run's config {path} cannot be read ({error})"
        if (folder / found.checkpoint.folder).resolve() == source.resolve().parent:
            return found, str(path)
    return None, f"no run's config.toml above {source} names it"


def export_tokenizer(destination: Path, run_cfg: JobConfig, origin: str) -> str:
    """The run's tokenizer files, chat template and generation ids into the export, as last_save_in_hf writes them;
    returns what was written, or what was left out and why."""
    try:
        tokenizer = build_tokenizer(run_cfg.model)
        template = run_cfg.training.chat_template
        if template and not Path(template).is_file():
            raise UserError(f"the run's training.chat_template {template} does not exist")
        copy_tokenizer(tokenizer.path, destination, template)
    except UserError as error:  # a run config that moved, or a tokenizer deleted since
        return f"{LEFT_OUT}, as the run's tokenizer (named by {origin}) cannot be used: {error}"
    return (
        f"config.json, the weights, the tokenizer files of {tokenizer.path} (named by {origin}), its chat template "
        "where it has one, and generation_config.json"
    )


def hf_to_dcp(source: Path, destination: Path, spec, cfg, overwrite: bool) -> None:
    reader = HFReader(source)
    check_destination(destination, overwrite)  # before the model is read into memory
    args = resolve_args(job_model_args(cfg, spec), reader.config.get("vocab_size"), source)
    model_name = f"{spec.name}/{cfg.model.flavor}"
    state = dict(read_hf_tensors(reader, model_shapes(spec, args), spec.hf_adapter, args, model_name))
    shutil.rmtree(destination / CHECKSUMS, ignore_errors=True)  # as a save does (manager.py): old records, the
    (destination / METADATA).unlink(missing_ok=True)  # .metadata, then an empty checksums folder before any file
    (destination / CHECKSUMS).mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(destination), no_dist=True)
    record_checksums(destination, 0)


def _pop_option(argv: list[str], name: str, default: str) -> tuple[list[str], str]:
    """Take `--name value` / `--name=value` out of argv (options that are not config keys)."""
    rest, value, i = [], default, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif argv[i].startswith(name + "="):
            value, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return rest, value


def run(argv: list[str]) -> None:
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if len(argv) < 3 or argv[0] not in COMMANDS or argv[1].startswith("--") or argv[2].startswith("--"):
        raise UserError(
            f"expected a command ({' or '.join(COMMANDS)}), a source and a destination folder; "
            f"{USAGE.split(chr(10))[0]}"
        )
    command, source, destination = argv[0], Path(argv[1]), Path(argv[2])
    flags, max_shard_mb = _pop_option(argv[3:], "--max_shard_mb", str(DEFAULT_MAX_SHARD_BYTES // 10**6))
    overwrite = "--overwrite" in flags
    flags = [flag for flag in flags if flag != "--overwrite"]
    try:
        max_shard_bytes = int(float(max_shard_mb) * 10**6)
    except ValueError:
        raise UserError(f"--max_shard_mb expects a number of megabytes, got {max_shard_mb!r}") from None
    cfg = load_config(flags)
    spec = get_model_spec(cfg.model.name)
    if spec.hf_adapter is None:
        raise UserError(f"model family {spec.name} has no Hugging Face adapter yet")
    job_model_args(cfg, spec)  # an unknown flavor fails here, before any file is touched
    if command == "hf-to-dcp":
        hf_to_dcp(source, destination, spec, cfg, overwrite)
        print(f"wrote {destination}")
        return
    named = any(flag.split("=")[0] in ("--model.name", "--model.flavor", "--job.config_file") for flag in flags)
    dcp_to_hf(source, destination, spec, cfg, max_shard_bytes, overwrite, named)
    run_cfg, origin = run_config(source, cfg, flags)
    if run_cfg is None:
        written = (
            f"{LEFT_OUT}, as the run's tokenizer is not known ({origin}); add --job.config_file "
            "<the run's config.toml> or --model.hf_assets_path <its tokenizer folder> to write them"
        )
    else:
        written = export_tokenizer(destination, run_cfg, origin)
    print(f"wrote {destination}: {written}")


def main(argv: list[str]) -> int:
    # Conversion runs in one process on purpose; DCP would warn about that on every load.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    return exit_code(run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
