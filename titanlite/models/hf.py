"""Hugging Face state-dict adapters: titanlite names and layouts <-> transformers' ones.

Every ModelSpec carries an adapter (`spec.hf_adapter`) with these methods:

    to_hf(state_dict, args)     titanlite tensors -> HF names and layouts
    from_hf(hf_state_dict, args) HF tensors -> titanlite names and layouts
    hf_names(name, args)        the HF tensors titanlite tensor `name` is built from
    hf_config(args, dtype)      the config.json dict of a model with these args
    args_from_hf_config(config) its inverse: the args of the model a config.json describes

Both conversions work on any subset of a state dict (one layer, one tensor) of full, unsharded
tensors, so checkpoints are converted a few tensors at a time, never a whole large model at once.
A family declares a table of name templates ("{}" stands for the layer number) and, where a
tensor's layout differs, overrides `tensor_to_hf` / `tensor_from_hf`; families whose tensors do
not map one to one (fused or stacked weights) override to_hf / from_hf / hf_names. Tied
embeddings (`args.tie_embeddings`) are handled here for every family: HF stores the shared
matrix once, as the token embedding.
"""

import abc
import re

import torch

from titanlite.errors import UserError


def rope_pairs_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of wq / wk from adjacent-pair RoPE (Meta) to split-half RoPE (HF).

    Within each head, Meta rotates rows (2i, 2i+1) together; HF's rotate_half rotates rows
    (i, i + head_dim/2). The same permutation as transformers' convert_llama_weights_to_hf.
    """
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_halves_to_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rope_pairs_to_halves."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


_NOT_COMPARED = ("architectures", "model_type", "torch_dtype", "dtype", "rope_theta", "rope_scaling")


def required(config: dict, key: str):
    """config[key], or one sentence when config.json lacks it (transformers always writes it)."""
    if config.get(key) is None:
        raise UserError(
            f"its config.json has no {key}, which fixes the model's shape; use a config.json written by transformers"
        )
    return config[key]


def rope_parameters(config: dict) -> dict:
    """RoPE's settings as one dict, rope_theta and rope_type included, from either spelling: transformers 5's
    rope_parameters, or the rope_theta and rope_scaling ({"type" or "rope_type", ...}) of older config.json files."""
    if isinstance(config.get("rope_parameters"), dict):
        rope = dict(config["rope_parameters"])
    else:
        rope = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", None)) or "default"
    return rope


def build_args(args_class, fields: dict):
    """args_class(**fields), its own consistency check worded as a config.json problem."""
    try:
        return args_class(**fields)
    except ValueError as error:
        raise UserError(f"its config.json describes a model titanlite cannot build ({error})") from None


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


class HFAdapter(abc.ABC):
    """One-to-one renaming through `names` (titanlite template -> HF template), plus per-tensor hooks.

    Subclasses set `names`, `architectures`, `model_type`, and implement `hf_config` (abstract, so a
    family that forgets it fails when its spec is built, not halfway through an export); `ignored`
    lists HF names (regexes) that carry nothing titanlite needs, e.g. precomputed RoPE tables.
    """

    names: dict[str, str] = {}
    ignored: tuple[str, ...] = ()
    # config.json keys that fix tensor shapes: an HF folder whose values differ cannot be loaded.
    shape_keys: tuple[str, ...] = ()
    # config.json keys hf_config writes that do not change the forward (dropout, init): never compared.
    free_keys: tuple[str, ...] = ()

    def __init__(self):
        self._to_hf = [(_template_regex(ours), theirs) for ours, theirs in self.names.items()]
        self._from_hf = [(_template_regex(theirs), ours) for ours, theirs in self.names.items()]
        self._ignored = [re.compile(pattern) for pattern in self.ignored]

    # --- per-tensor hooks: layout changes (identity by default) ---
    def tensor_to_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor

    def tensor_from_hf(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        """`name` is the titanlite name the tensor becomes."""
        return tensor

    # --- names ---
    @staticmethod
    def _rename(name: str, table) -> str | None:
        for pattern, target in table:
            match = pattern.match(name)
            if match:
                return target.replace("{}", match.group(1)) if match.groups() else target
        return None

    def hf_name(self, name: str) -> str:
        hf = self._rename(name, self._to_hf)
        if hf is None:
            raise ValueError(f"{type(self).__name__} has no Hugging Face name for {name}")
        return hf

    def titanlite_name(self, hf_name: str) -> str | None:
        """None for HF tensors titanlite does not use (listed in `ignored`)."""
        ours = self._rename(hf_name, self._from_hf)
        if ours is None and not any(p.search(hf_name) for p in self._ignored):
            raise UserError(
                f"the Hugging Face tensor {hf_name} has no place in {type(self).__name__.removesuffix('HFAdapter')} "
                "models"
            )
        return ours

    def hf_names(self, name: str, args) -> list[str]:
        if args.tie_embeddings and name == "output.weight":
            name = "tok_embeddings.weight"
        return [self.hf_name(name)]

    # --- conversions ---
    def to_hf(self, state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        return {
            self.hf_name(name): self.tensor_to_hf(name, tensor, args)
            for name, tensor in state_dict.items()
            if not (args.tie_embeddings and name == "output.weight")
        }

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        out = {}
        for hf_name, tensor in hf_state_dict.items():
            name = self.titanlite_name(hf_name)
            if name is not None:
                out[name] = self.tensor_from_hf(name, tensor, args)
        if args.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    @abc.abstractmethod
    def hf_config(self, args, dtype: str = "float32") -> dict:
        """config.json for these args, with `dtype` ("float32" / "bfloat16") as torch_dtype."""

    def args_from_hf_config(self, config: dict):
        """The args of the model `config` (a config.json) describes; UserError, worded as "its config.json ...",
        for a setting titanlite's model does not have. A family without it cannot start from a folder."""
        raise UserError(
            f"titanlite cannot read a {self.architectures[0]} config.json yet; start from a flavor (model.flavor) "
            "and load the weights with checkpoint.initial_load_path and initial_load_in_hf"
        )

    def unsupported_setting(self, config: dict, args) -> str | None:
        """The first config.json value that the model built from `args` would not compute, as a phrase; None if
        all agree. What args_from_hf_config does not read (activation, biases, fixed routing) is checked here:
        every key hf_config writes with a value must agree where config.json sets it. RoPE is read and checked
        there (its two spellings); `free_keys` lists keys that do not change the forward (dropout, init)."""
        for key, ours in self.hf_config(args).items():
            theirs = config.get(key)
            if key in _NOT_COMPARED or key in self.free_keys or ours is None or theirs is None or theirs == ours:
                continue
            return f"its config.json has {key} {theirs!r} where titanlite's model computes {ours!r}"
        return None

    def left_out(self, config: dict, args) -> str | None:
        """What of the folder `config` describes the model built from `args` does not read (so neither trains nor
        exports), as a phrase naming the key that keeps it; None: it reads all of it."""
        return None

    def config_mismatch(self, config: dict, args) -> str | None:
        """The first shape-defining config.json value that differs from `args`, as a phrase; None if all fit."""
        expected = self.hf_config(args)
        for key in self.shape_keys:
            if key in config and config[key] != expected[key]:
                return f"its config.json has {key} {config[key]} where this model has {expected[key]}"
        return None
