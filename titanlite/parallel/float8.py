"""Float8 training of the Linear layers with torchao (an optional extra: pip install 'titanlite[float8]').

Float8 matmuls need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell). Every
way this can fail before training (no GPU, an older GPU, no torchao, options that do not go
together) stops the run with one sentence. Conversion happens on the meta-device model, before
AC, compile and FSDP wrap the blocks, so the FQNs are the plain ones.
"""

import torch
from torch import nn

from titanlite.config_sections import Float8
from titanlite.errors import UserError

# torchao's float8 matmuls need both dimensions of the weight divisible by 16.
_DIM_MULTIPLE = 16


def check_float8_hardware() -> None:
    if not torch.cuda.is_available():
        raise UserError(
            "float8.enable needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            "this run is on CPU: set float8.enable false"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        raise UserError(
            f"float8.enable needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); {name} has "
            f"{major}.{minor}: set float8.enable false"
        )


def check_float8(cfg: Float8) -> None:
    """Refuse, with one sentence, what cannot run here; call before importing torchao. Emulation
    (float8.emulate, for tests) needs no float8 hardware."""
    if not cfg.emulate:
        check_float8_hardware()
    if cfg.recipe_name != "tensorwise" and cfg.enable_fsdp_float8_all_gather:
        raise UserError(
            f"float8.enable_fsdp_float8_all_gather works with recipe_name tensorwise only, not {cfg.recipe_name}"
        )
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise UserError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather true "
            "(the scales it precomputes are those of the float8 all-gather)"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError(
            "float8.enable needs torchao, which is not installed: pip install torchao (or pip install -e '.[float8]')"
        ) from None


# MoE routers (models/moe.py's gate): their scores choose the experts, which float8 rounding would change.
_ROUTER_SUFFIX = "feed_forward.gate"


def _keeps_high_precision(fqn: str, module: nn.Module, filter_fqns: list[str]) -> bool:
    if any(name in fqn for name in filter_fqns) or fqn.endswith(_ROUTER_SUFFIX):
        return True
    return module.in_features % _DIM_MULTIPLE != 0 or module.out_features % _DIM_MULTIPLE != 0


def float8_config(cfg: Float8, emulate: bool = False):
    """torchao's Float8LinearConfig for the recipe; emulate (or float8.emulate; tests only) casts without float8
    kernels."""
    from torchao.float8 import Float8LinearConfig

    emulate = emulate or cfg.emulate
    if cfg.recipe_name == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather, emulate=emulate)
    config = Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    if emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    return config


def convert_linears(model: nn.Module, cfg: Float8, emulate: bool = False) -> None:
    """Swap every nn.Linear not filtered out (filter_fqns, MoE routers, or dims not multiples of 16) for torchao's
    Float8Linear, in place."""
    from torchao.float8 import convert_to_float8_training

    def keep_float8(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and not _keeps_high_precision(fqn, module, cfg.filter_fqns)

    convert_to_float8_training(model, config=float8_config(cfg, emulate), module_filter_fn=keep_float8)


def apply_float8(model: nn.Module, cfg: Float8) -> None:
    if not cfg.enable:
        return
    check_float8(cfg)
    convert_linears(model, cfg)


def register_float8_scale_precompute(optimizer: torch.optim.Optimizer, model: nn.Module, cfg: Float8) -> None:
    """With float8 all-gather, compute the scales of all float8 weights in one go after each
    optimizer step instead of one small reduction per weight in the next forward. Also after a
    checkpoint's optimizer state is loaded (the weights are loaded first): the precomputed scales
    round differently from the per-weight ones, so a resumed run's first step would otherwise differ."""
    if not (cfg.enable and cfg.precompute_float8_dynamic_scale_for_fsdp):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    optimizer.register_load_state_dict_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
