"""LoRA: low-rank adapters on chosen linear layers, every other weight frozen (the [lora] section).

A target layer computes x W^T + (alpha / rank) * dropout(x) A^T B^T, with A [rank, in] and B [out, rank]
trainable and W frozen. B starts at zero, so the model starts as its base. The adapters are added to
the meta model before it is parallelized, so FSDP shards frozen and trainable parameters in the same
groups, and the parameter names of the base stay as they are (`layers.0.attention.wq.weight`): the
base loads from a DCP checkpoint or a Hugging Face folder unchanged. A checkpoint holds only the
adapters and their optimizer state; a resume reloads the base from checkpoint.initial_load_path (or
initialises it again from job.seed) first.
"""

import contextlib
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from titanlite.config_sections import LoRA
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.init import full_tensor, trunc_normal_


class LoRALinear(nn.Linear):
    adapters_on = True  # adapters_off() clears it: the layer is then its frozen base (DPO's reference)

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: LoRA, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.scale = cfg.alpha / cfg.rank
        # No dropout module at 0: nn.Dropout(0) would still copy the input of every adapted layer.
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.lora_a = nn.Parameter(torch.empty(cfg.rank, in_features, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, cfg.rank, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return super().forward(x)
        return super().forward(x) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale

    def init_lora(self, key: str, seed: int) -> None:
        trunc_normal_(self.lora_a, self.in_features**-0.5, key=f"{key}.lora_a", seed=seed)
        with torch.no_grad():
            self.lora_b.zero_()


FUSED = {"wqkv": ("wq", "wk", "wv")}  # GPT-2's one attention input projection holds q, k and v


def naming_targets(name: str, module: nn.Module, targets: list[str]) -> set[str]:
    """The targets that name this layer: an nn.Linear by its own name, a fused wqkv also by wq, wk or wv."""
    if type(module) is not nn.Linear:
        return set()
    own = name.rsplit(".", 1)[-1]
    return {own, *FUSED.get(own, ())} & set(targets)


def lora_targets(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of every nn.Linear that cfg.target_modules names (a fused wqkv by any of wq, wk, wv);
    one sentence where a target names MoE experts' stacked weights or matches nothing."""
    stacked = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] in targets})
    if stacked:
        raise UserError(f"lora.target_modules {','.join(stacked)} names the MoE experts' stacked weights, which take no LoRA "
                        "adapter; drop them from lora.target_modules (attention and dense layers still can)")
    found, matched = [], set()
    for name, module in model.named_modules():
        names = naming_targets(name, module, targets)
        if names:
            found.append((name, module))
            matched |= names
    unmatched = [target for target in targets if target not in matched]
    if unmatched:
        layers = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})
        raise UserError(f"lora.target_modules {','.join(unmatched)} matches no linear layer of the model; name layers it has "
                        f"({','.join(layers)})")
    if "output" in matched and getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise UserError("lora.target_modules output adapts the output layer, which this model ties to its token embeddings "
                        "(tie_word_embeddings), so no merged export could hold it; drop output from lora.target_modules")
    return found


def adapted_summary(names: list[str]) -> str:
    """The adapted layers in a few words: "layers.*.attention.wq (2), output (1)"."""
    counts: dict[str, int] = {}
    for name in names:
        pattern = re.sub(r"^layers\.\d+\.", "layers.*.", name)
        counts[pattern] = counts.get(pattern, 0) + 1
    return ", ".join(f"{pattern} ({count})" for pattern, count in counts.items())


def apply_lora(model: nn.Module, cfg: LoRA, whole: bool = True) -> None:
    """Replace every nn.Linear whose own name is in cfg.target_modules by a LoRALinear (on the meta device)
    and freeze everything but the adapters. A no-op with rank 0. `whole`: the whole model (not a slice the
    planner measures), so every target must match and the adapted layers are logged."""
    if not cfg.rank:
        return
    if whole:
        targets = lora_targets(model, cfg.target_modules)
        logger.info(f"LoRA rank {cfg.rank} adapters on {len(targets)} linear layers: {adapted_summary([n for n, _ in targets])}")
    else:
        targets = [(name, module) for name, module in model.named_modules() if naming_targets(name, module, cfg.target_modules)]
    for param in model.parameters():
        param.requires_grad_(False)
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        with torch.device(linear.weight.device):
            adapted = LoRALinear(linear.in_features, linear.out_features, linear.bias is not None, cfg, linear.weight.dtype)
        adapted.weight.requires_grad_(False)
        if adapted.bias is not None:
            adapted.bias.requires_grad_(False)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, adapted)
    if cfg.base_dtype == "bfloat16":
        keep_frozen_linears_in_bf16(model)


def keep_frozen_linears_in_bf16(model: nn.Module) -> None:
    """lora.base_dtype bfloat16: every frozen linear weight (and bias) stored in bf16. They compute in bf16
    anyway (FSDP's param_dtype or autocast casts them so, rounding the same way), so no result changes;
    embeddings and norms stay as they are (autocast does not cast their ops, and one process's results
    would move)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for name in ("weight", "bias"):
                param = getattr(module, name)
                if param is not None:
                    setattr(module, name, nn.Parameter(param.to(torch.bfloat16), requires_grad=False))


def init_lora(model: nn.Module, seed: int) -> None:
    """After the model's init_weights: A drawn (the same values under any sharding, and with or without activation
    checkpointing or compile: the key is the state dict's name, their wrappers left out), B zero."""
    for name, module in adapted_layers(model).items():
        module.init_lora(name, seed)


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LoRALinear) for module in model.modules())


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model as its frozen base while inside: every adapted layer skips its adapter (no second copy of the base)."""
    layers = [module for module in model.modules() if isinstance(module, LoRALinear)]
    for layer in layers:
        layer.adapters_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_on = True


def adapted_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """name -> LoRALinear, by the names of the model's state dict (AC's and compile's wrappers left out)."""
    return {name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): module
            for name, module in model.named_modules() if isinstance(module, LoRALinear)}


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
        raise UserError(f"checkpoint {path} holds LoRA adapters only, on other layers than this run's lora.target_modules "
                        f"({other} is adapted in {where} alone); resume with the lora.target_modules it was trained with, "
                        "or start the new adapters in another job.dump_folder")
    for fqn, shape in ours.items():
        if fqn.endswith(".lora_a") and saved[fqn] != shape:
            raise UserError(f"checkpoint {path} holds LoRA adapters only, of rank {saved[fqn][0]}, but lora.rank is {shape[0]}; "
                            f"resume with lora.rank {saved[fqn][0]}, or start the new adapters in another job.dump_folder")


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
    if theirs["digest"] is None and theirs["path"] == ours["path"] or same_digest(theirs["digest"] or [], ours["digest"]):
        return
    raise UserError(f"checkpoint {path} holds LoRA adapters trained on another base than this run's ({ours['path']}: its "
                    f"weights differ); set checkpoint.initial_load_path to the base they were trained on ({theirs['path']}), "
                    "or start the adapters in another job.dump_folder")


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
    """Whether the Hugging Face layout of this weight is its transpose (GPT-2's Conv1D): told by a probe of distinct values."""
    probe = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape[0], shape[1])
    hf = hf_adapter.tensor_to_hf(name, probe, args)
    return hf.shape == probe.t().shape and torch.equal(hf, probe.t())


@torch.no_grad()
def save_peft_adapter(adapter_state: dict, folder: Path, hf_adapter, args, model: nn.Module, base: str, writer_rank: bool) -> None:
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
        tensors[f"{prefix}.lora_B.weight"] = (b.float() if transposed else hf_adapter.tensor_to_hf(f"{name}.weight", b.float(), args)).contiguous()
        targets.add(hf_weight.removesuffix(".weight").rsplit(".", 1)[-1])
    if not writer_rank:
        return
    first = next(iter(layers.values()))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.lora_a.shape[0],
              "lora_alpha": first.scale * first.lora_a.shape[0], "lora_dropout": getattr(first.dropout, "p", 0.0),
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": conv1d, "use_rslora": False,
              "base_model_name_or_path": base_model_name(base), "inference_mode": True}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
