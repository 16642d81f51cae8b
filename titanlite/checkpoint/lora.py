"""LoRA in checkpoints and exports: an adapters-only checkpoint resumes only into the same adapters on the same
base (checked by content), the adapters merged into their weights for a Hugging Face export, and the adapters
alone as a PEFT folder that peft.PeftModel.from_pretrained puts on the base. The adapters themselves are
models/lora.py's."""

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from titanlite.errors import UserError
from titanlite.models.init import full_tensor
from titanlite.models.lora import adapted_layers, is_adapter


def merge_lora(full: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of some layers with each adapter merged into its weight: W + scale * B @ A."""
    merged = {name: t for name, t in full.items() if not is_adapter(name)}
    for name, module in adapted_layers(model).items():
        if f"{name}.lora_a" in full:
            delta = full[f"{name}.lora_b"].float() @ full[f"{name}.lora_a"].float() * module.scale
            merged[f"{name}.weight"] = (full[f"{name}.weight"].float() + delta).to(full[f"{name}.weight"].dtype)
    return merged


def check_adapters_fit(saved: dict[str, tuple], ours: dict[str, tuple], path) -> None:
    """An adapters-only checkpoint resumes only into the same adapters: one sentence naming lora.rank or
    lora.target_modules where they differ (the model's own shapes are the base's, never in the checkpoint)."""
    saved = {fqn: shape for fqn, shape in saved.items() if is_adapter(fqn)}
    ours = {fqn: shape for fqn, shape in ours.items() if is_adapter(fqn)}
    if set(saved) != set(ours):
        other = sorted(set(saved) ^ set(ours))[0].rsplit(".", 1)[0]
        where = "the checkpoint" if other + ".lora_a" in saved else "this run"
        raise UserError(
            f"checkpoint {path} holds LoRA adapters only, on other layers than this run's lora.target_modules "
            f"({other} is adapted in {where} alone); resume with the lora.target_modules it was trained with, "
            "or start the new adapters in another job.dump_folder"
        )
    for fqn, shape in ours.items():
        if fqn.endswith(".lora_a") and saved[fqn] != shape:
            raise UserError(
                f"checkpoint {path} holds LoRA adapters only, of rank {saved[fqn][0]}, but lora.rank is {shape[0]}; "
                f"resume with lora.rank {saved[fqn][0]}, or start the new adapters in another job.dump_folder"
            )


def check_not_adapters_only(saved: dict[str, tuple], path) -> None:
    """A model without adapters (lora.rank 0) takes no adapters-only checkpoint: said by its key, not as the base's
    every tensor missing."""
    adapters = {fqn: shape for fqn, shape in saved.items() if is_adapter(fqn)}
    if adapters and len(adapters) == len(saved):
        rank = next(shape[0] for fqn, shape in adapters.items() if fqn.endswith(".lora_a"))
        raise UserError(
            f"checkpoint {path} holds LoRA adapters only (rank {rank}), but lora.rank is 0 here; set lora.rank "
            f"{rank} and the other [lora] keys the run was trained with (the base comes from "
            "checkpoint.initial_load_path)"
        )


@torch.no_grad()
def base_record(base: str, state: dict) -> str:
    """The frozen base as an adapters-only checkpoint records it: where it came from, and its content (per
    tensor the float64 sum and sum of squares, DTensors reduced over their mesh, so any layout gives the same
    numbers up to rounding). Another base at the same path is thus another base."""
    digest = []
    for name in sorted(state):
        values = state[name].double()
        digest += [float(full_tensor(values.sum())), float(full_tensor((values * values).sum()))]
    return json.dumps({"path": base, "digest": digest})


def same_digest(saved: list, ours: list) -> bool:
    return len(saved) == len(ours) and all(abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1.0) for a, b in zip(saved, ours))


def check_same_base(saved: str, base: str, path) -> None:
    """The adapters resume only on the base they were trained on: by content (base_record); a checkpoint
    from before content was recorded names its base by path alone."""
    ours = json.loads(base)
    try:
        theirs = json.loads(saved)
    except ValueError:
        theirs = {"path": saved, "digest": None}
    if (
        theirs["digest"] is None
        and theirs["path"] == ours["path"]
        or same_digest(theirs["digest"] or [], ours["digest"])
    ):
        return
    raise UserError(
        f"checkpoint {path} holds LoRA adapters trained on another base than this run's ({ours['path']}: its "
        f"weights differ); set checkpoint.initial_load_path to the base they were trained on ({theirs['path']}), "
        "or start the adapters in another job.dump_folder"
    )


def base_model_name(base: str) -> str:
    """The base as PEFT's base_model_name_or_path names it: a folder's hub name where it has one (a hub cache
    snapshot .../models--org--name/snapshots/<sha>, or config.json's "_name_or_path" when that is no local
    path), else the base as given."""
    cached = re.search(r"models--([^/]+)--([^/]+)/snapshots/", base)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    try:
        named = json.loads((Path(base) / "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        named = ""
    hub = isinstance(named, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", named) and not Path(named).exists()
    return named if hub else base


def is_transposed(hf_adapter, name: str, args, shape) -> bool:
    """Whether the Hugging Face layout of this weight is its transpose (GPT-2's Conv1D): told by a probe of distinct
    values."""
    probe = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape[0], shape[1])
    hf = hf_adapter.tensor_to_hf(name, probe, args)
    return hf.shape == probe.t().shape and torch.equal(hf, probe.t())


@torch.no_grad()
def save_peft_adapter(
    adapter_state: dict, folder: Path, hf_adapter, args, model: nn.Module, base: str, writer_rank: bool
) -> None:
    """The adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors) that
    peft.PeftModel.from_pretrained puts on the transformers model of the base. A's rows are the rank, so
    only B takes the layer's Hugging Face layout (the RoPE row order of q and k)."""
    layers = adapted_layers(model)
    tensors, targets, conv1d = {}, set(), False
    for name, layer in layers.items():
        hf_weight = hf_adapter.hf_name(f"{name}.weight")  # e.g. model.layers.0.self_attn.q_proj.weight
        prefix = "base_model.model." + hf_weight.removesuffix(".weight")
        a, b = full_tensor(adapter_state[f"{name}.lora_a"]), full_tensor(adapter_state[f"{name}.lora_b"])
        tensors[f"{prefix}.lora_A.weight"] = a.float().contiguous()
        # PEFT keeps B in nn.Linear's orientation for GPT-2's transposed Conv1D too (fan_in_fan_out)
        transposed = is_transposed(hf_adapter, f"{name}.weight", args, layer.weight.shape)
        conv1d |= transposed
        tensors[f"{prefix}.lora_B.weight"] = (
            b.float() if transposed else hf_adapter.tensor_to_hf(f"{name}.weight", b.float(), args)
        ).contiguous()
        targets.add(hf_weight.removesuffix(".weight").rsplit(".", 1)[-1])
    if not writer_rank:
        return
    first = next(iter(layers.values()))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.lora_a.shape[0],
        "lora_alpha": first.scale * first.lora_a.shape[0],
        "lora_dropout": getattr(first.dropout, "p", 0.0),
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "use_rslora": False,
        "base_model_name_or_path": base_model_name(base),
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
