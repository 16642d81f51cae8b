"""Hugging Face folders (config.json + safetensors, sharded with model.safetensors.index.json).

Tensors move a layer at a time: export gathers and writes one layer's tensors before the next,
import reads only the HF tensors each parameter needs, so memory stays near one layer plus one
shard file, whatever the model size.
"""

import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titanlite.checkpoint.export_files import write_generation_ids
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.init import full_tensor, local_view  # (local shard, its offset in the full tensor)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def layer_groups(names: Iterable[str]) -> Iterator[list[str]]:
    """Names grouped by transformer block ("layers.N." prefix), others by module (output.weight with its LoRA
    adapters), in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        match = re.match(r"layers\.(\d+)\.", name)
        groups.setdefault(match.group(0) if match else name.rpartition(".")[0], []).append(name)
    yield from groups.values()


class HFWriter:
    """Writes tensors into safetensors shards of at most max_shard_bytes, then the index and config.

    Shards are written as they fill (named once their count is known), so only one shard's
    tensors are held at a time.
    """

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in [*self.folder.glob("model*.safetensors"), self.folder / INDEX]:
            old.unlink(missing_ok=True)  # a previous export with another shard count
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.max_shard_bytes:
                self._flush()
            self.pending[name] = tensor.detach().contiguous().cpu()
            self.pending_bytes += size
            self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, str(self._part(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _part(self, index: int) -> Path:
        return self.folder / f"model-{index + 1:05d}.part"

    def finish(self, config: dict) -> None:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            self._part(0).rename(self.folder / SINGLE)
        else:
            weight_map = {}
            for index, names in enumerate(self.shards):
                name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
                self._part(index).rename(self.folder / name)
                weight_map.update(dict.fromkeys(names, name))
            index_json = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
        (self.folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        make_readable(self.folder)


class HFReader:
    """Lazy access to the tensors of a Hugging Face model folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise UserError(f"{self.folder} is not a Hugging Face model folder: it has no config.json")
        try:
            self.config = json.loads((self.folder / "config.json").read_text())
            if (self.folder / INDEX).is_file():
                weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
            elif (self.folder / SINGLE).is_file():
                with safe_open(str(self.folder / SINGLE), "pt") as f:
                    weight_map = dict.fromkeys(f.keys(), SINGLE)
            else:
                raise UserError(f"{self.folder} holds no {SINGLE} and no {INDEX}; only safetensors weights can be read")
        except UserError:
            raise
        except Exception as error:  # bad JSON, a truncated safetensors header, unreadable files
            raise UserError(
                f"the Hugging Face folder {self.folder} cannot be read ({type(error).__name__}: {error})"
            ) from None
        self.weight_map: dict[str, str] = weight_map
        self._files: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise UserError(f"the Hugging Face folder {self.folder} lacks the tensor {name}; it holds another model")
        file = self.weight_map[name]
        try:
            if file not in self._files:
                self._files[file] = safe_open(str(self.folder / file), "pt")
            return self._files[file].get_tensor(name)
        except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
            raise UserError(f"{self.folder / file} cannot be read ({type(error).__name__}: {error})") from None


def write_hf_folder(
    layers: Iterable[dict[str, torch.Tensor]],
    folder: Path,
    adapter,
    args,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    write: bool = True,
) -> None:
    """Convert each group of full titanlite tensors to HF names and `dtype` and write them, then the
    config. Without `write` the groups are still drawn (their gathers are collective), not written."""
    writer = HFWriter(folder, max_shard_bytes) if write else None
    for full in layers:
        if writer:
            writer.add({name: t.to(dtype) for name, t in adapter.to_hf(full, args).items()})
    if writer:
        writer.finish(adapter.hf_config(args, str(dtype).removeprefix("torch.")))


def make_readable(folder: Path) -> None:
    """Every file of an exported folder readable by all (0644): an inference server runs as another user."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


def copy_tokenizer(tokenizer_file: Path, folder: Path, chat_template: str = "", generation: bool = True) -> None:
    """The run's tokenizer into an exported folder, which is then a whole model: transformers and vLLM load it,
    and a titanlite run starts from it (model.hf_assets_path). A tokenizer.json brings the files beside it, and
    the run's own training.chat_template (as chat_template.jinja) replaces the folder's; then config.json gets
    the bos and eos ids and generation_config.json the ids generation stops at (export_files.py; not in a PEFT
    adapter's folder, whose model is the base's)."""
    tokenizer_file = Path(tokenizer_file)
    is_json = tokenizer_file.suffix == ".json"
    shutil.copyfile(tokenizer_file, folder / ("tokenizer.json" if is_json else "tokenizer.model"))
    for name in TOKENIZER_SIDE_FILES if is_json else ():
        if (tokenizer_file.parent / name).is_file():
            shutil.copyfile(tokenizer_file.parent / name, folder / name)
    if is_json and chat_template:
        shutil.copyfile(chat_template, folder / "chat_template.jinja")
    if generation:
        write_generation_ids(tokenizer_file.parent, folder, chat_template)
    make_readable(folder)


@torch.no_grad()
def save_model_as_hf(
    state_dict: dict, folder: Path, adapter, args, dtype: torch.dtype, writer_rank: bool, merge=None
) -> None:
    """Write a (possibly sharded) model state dict as an HF folder, one layer at a time; `merge` turns each
    layer's full tensors into the model's own (LoRA: the adapters merged into their weights).

    Every rank takes part in gathering each layer; only `writer_rank` holds it and writes.
    """
    layers = ({name: full_tensor(state_dict[name]) for name in group} for group in layer_groups(state_dict))
    if merge is not None:
        layers = map(merge, layers)
    write_hf_folder(layers, folder, adapter, args, dtype, write=writer_rank)


def read_hf_tensors(
    reader: HFReader, shapes: dict[str, tuple], adapter, args, model_name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(titanlite name, full tensor in titanlite layout) for each name in `shapes`, read one at a
    time; stops with one sentence at the first config value or tensor shape that does not fit."""
    mismatch = adapter.config_mismatch(reader.config, args)
    if mismatch:
        raise UserError(f"the Hugging Face folder {reader.folder} does not fit {model_name}: {mismatch}")
    left_out = adapter.left_out(reader.config, args)
    if left_out:
        logger.warning(f"the Hugging Face folder {reader.folder} holds {left_out}")
    for name, shape in shapes.items():
        hf = {hf_name: reader.get(hf_name) for hf_name in adapter.hf_names(name, args)}
        full = adapter.from_hf(hf, args)[name]
        if tuple(full.shape) != tuple(shape):
            raise UserError(
                f"the Hugging Face folder {reader.folder} does not fit {model_name}: {name} is "
                f"{list(full.shape)} there but {list(shape)} here"
            )
        yield name, full


@torch.no_grad()
def load_model_from_hf(state_dict: dict, folder: Path, adapter, args, model_name: str) -> None:
    """Copy an HF folder's weights into a (possibly sharded) model state dict, in place; each
    rank reads the tensors one at a time and keeps only its own shard of each."""
    shapes = {name: tuple(t.shape) for name, t in state_dict.items()}
    for name, full in read_hf_tensors(HFReader(folder), shapes, adapter, args, model_name):
        local, offset = local_view(state_dict[name])
        local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
