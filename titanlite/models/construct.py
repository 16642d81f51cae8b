"""A model as training and generation both build it: its args from the [model] section, the whole model on the
meta device (with LoRA's adapters), its parallelizer, and its shards allocated and initialised. build.py builds the
training run from these; inference/model.py a model to generate with.
"""

import dataclasses
import functools
import os
from typing import Callable

import torch
from torch import nn

from titanlite.config_sections import LoRA, Model
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError
from titanlite.models import get_model_args
from titanlite.models.hf_folder import is_model_folder, read_model_folder
from titanlite.models.lora import apply_lora, init_lora
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import ParallelizeSettings, parallelize_decoder
from titanlite.parallel.tp import place_grads_like_params
from titanlite.run import model_label


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def model_args(cfg: Model, spec, tokenizer_vocab: int):
    """The [model] section's args: the flavor's (or those of the Hugging Face folder model.hf_assets_path's
    config.json) with the vocab taken from the tokenizer where the flavor leaves it open, model.n_layers blocks where
    it is set, and model.mtp_layers; what training adds is resolve_model_args'. Generation starts here."""
    if is_model_folder(cfg.hf_assets_path):
        args = read_model_folder(cfg.hf_assets_path, cfg.name).args
    else:
        args = get_model_args(spec, cfg.flavor)
    args = dataclasses.replace(args, reset_position_ids=cfg.reset_position_ids)
    if cfg.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.n_layers)
    where = model_label(cfg)
    if cfg.mtp_layers:  # recipes (issue 46): DeepSeek-V3 multi-token prediction, models/deepseek_v3/mtp.py
        if not hasattr(args, "mtp_layers"):
            raise UserError(
                f"model.mtp_layers {cfg.mtp_layers}: {where} has no multi-token prediction; set model.mtp_layers 0"
            )
        args = dataclasses.replace(args, mtp_layers=cfg.mtp_layers, mtp_loss_weight=cfg.mtp_loss_weight)
    if args.vocab_size == -1:
        args = dataclasses.replace(args, vocab_size=tokenizer_vocab)
    elif args.vocab_size < tokenizer_vocab:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab} tokens but {where} has a vocabulary of {args.vocab_size}; "
            "use that model's own tokenizer (model.tokenizer_path) or a debugmodel flavor"
        )
    return args


def meta_model(spec, args, param_dtype: str, lora: LoRA) -> nn.Module:
    """The whole model on the meta device, in the parameter dtype (init_weights keeps RoPE tables in fp32),
    with LoRA adapters where [lora] asks for them."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to(dtype=DTYPES[param_dtype])
    apply_lora(model, lora)
    return model


def parallelizer(spec, dims: ParallelDims, settings: ParallelizeSettings) -> Callable[[nn.Module], nn.Module]:
    """model -> the model parallelized with the family's TP plan (a whole model, or a pipeline stage)."""
    return functools.partial(parallelize_decoder, dims=dims, settings=settings, apply_tp=spec.apply_tp)


def materialize(part: nn.Module, seed: int, device: torch.device, tp_enabled: bool) -> nn.Module:
    """A parallelized meta model (or one pipeline stage of it) allocated on the device, only this rank's
    shards, and initialised from the seed (its LoRA adapters too), in training mode."""
    part.to_empty(device=device)
    if tp_enabled:
        place_grads_like_params(part)
    part.init_weights(seed=seed)
    init_lora(part, seed)
    part.train()
    return part
