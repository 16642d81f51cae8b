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
import re

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.config_sections import LoRA
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.init import trunc_normal_


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
    stacked = sorted(
        {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] in targets}
    )
    if stacked:
        raise UserError(
            f"lora.target_modules {','.join(stacked)} names the MoE experts' stacked weights, which take no LoRA "
            "adapter; drop them from lora.target_modules (attention and dense layers still can)"
        )
    found, matched = [], set()
    for name, module in model.named_modules():
        names = naming_targets(name, module, targets)
        if names:
            found.append((name, module))
            matched |= names
    unmatched = [target for target in targets if target not in matched]
    if unmatched:
        layers = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        )
        raise UserError(
            f"lora.target_modules {','.join(unmatched)} matches no linear layer of the model; name layers it has "
            f"({','.join(layers)})"
        )
    if "output" in matched and getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise UserError(
            "lora.target_modules output adapts the output layer, which this model ties to its token embeddings "
            "(tie_word_embeddings), so no merged export could hold it; drop output from lora.target_modules"
        )
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
        logger.info(
            f"LoRA rank {cfg.rank} adapters on {len(targets)} linear layers: {adapted_summary([n for n, _ in targets])}"
        )
    else:
        targets = [
            (name, module) for name, module in model.named_modules() if naming_targets(name, module, cfg.target_modules)
        ]
    for param in model.parameters():
        param.requires_grad_(False)
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        with torch.device(linear.weight.device):
            adapted = LoRALinear(
                linear.in_features, linear.out_features, linear.bias is not None, cfg, linear.weight.dtype
            )
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
    return {
        name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): module
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
    }
