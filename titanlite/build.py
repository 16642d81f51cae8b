"""The build path the trainer and the planner share: a job's model args (from its flavor), the model on
the meta device, how it is parallelized, and the accumulation steps. Whatever the trainer builds, the
planner counts, because both call these functions."""

import dataclasses
import functools
import os
from typing import Callable

import torch
from torch import nn

from titanlite.config_sections import JobConfig, LoRA, Model, Training
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError
from titanlite.lora import apply_lora, init_lora
from titanlite.models import get_model_args
from titanlite.models.hf_folder import is_model_folder, read_model_folder
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import ParallelizeSettings, parallelize_decoder
from titanlite.parallel.pp import build_pipeline
from titanlite.parallel.tp import place_grads_like_params


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def model_label(cfg: Model) -> str:
    """The model as logs, errors and checkpoints name it; a depth override is part of the name."""
    label = f"{cfg.name}/{cfg.flavor}"
    return f"{label} with model.n_layers {cfg.n_layers}" if cfg.n_layers else label


def resolve_model_args(cfg: JobConfig, spec, tokenizer_vocab: int):
    """The flavor's args (or those of the Hugging Face folder model.hf_assets_path's config.json) with the vocab
    taken from the tokenizer where the flavor leaves it open, model.n_layers blocks where it is set, and
    model.reset_position_ids (always for chat data: each conversation starts at position 0, as at inference)."""
    if is_model_folder(cfg.model.hf_assets_path):
        args = read_model_folder(cfg.model.hf_assets_path, cfg.model.name).args
    else:
        args = get_model_args(spec, cfg.model.flavor)
    reset = cfg.model.reset_position_ids or cfg.training.dataset_format != "text"
    args = dataclasses.replace(args, reset_position_ids=reset)
    if cfg.model.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    where = model_label(cfg.model)
    if cfg.model.mtp_layers:  # recipes (issue 46): DeepSeek-V3 multi-token prediction, models/deepseek_v3/mtp.py
        if not hasattr(args, "mtp_layers"):
            raise UserError(f"model.mtp_layers {cfg.model.mtp_layers}: {where} has no multi-token prediction; set model.mtp_layers 0")
        args = dataclasses.replace(args, mtp_layers=cfg.model.mtp_layers, mtp_loss_weight=cfg.model.mtp_loss_weight)
    if args.vocab_size == -1:
        args = dataclasses.replace(args, vocab_size=tokenizer_vocab)
    elif args.vocab_size < tokenizer_vocab:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab} tokens but {where} has a vocabulary of {args.vocab_size}; "
            "use that model's own tokenizer (model.tokenizer_path) or a debugmodel flavor"
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise UserError(
            f"training.seq_len {cfg.training.seq_len} exceeds the context of {where} ({args.max_seq_len}); lower training.seq_len"
        )
    return args


def grad_accumulation_steps(cfg: Training, dp_degree: int) -> int:
    """Micro-steps per optimizer step so that local x dp x micro-steps = global batch."""
    per_micro_step = cfg.local_batch_size * dp_degree
    if cfg.global_batch_size == -1:
        return 1
    if cfg.global_batch_size < per_micro_step or cfg.global_batch_size % per_micro_step:
        raise UserError(
            f"training.global_batch_size {cfg.global_batch_size} must be a multiple of local_batch_size "
            f"{cfg.local_batch_size} x data-parallel degree {dp_degree} = {per_micro_step}"
        )
    return cfg.global_batch_size // per_micro_step


def meta_model(spec, args, param_dtype: str, lora: LoRA) -> nn.Module:
    """The whole model on the meta device, in the parameter dtype (init_weights keeps RoPE tables in fp32),
    with LoRA adapters where [lora] asks for them."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to(dtype=DTYPES[param_dtype])
    apply_lora(model, lora)
    return model


def model_flops_per_token(spec, model: nn.Module, seq_len: int) -> float:
    """The family's training FLOPs per token, less what frozen weights (LoRA's base) do not cost: their
    gradient, 2 FLOPs per weight and token, is never computed. The token embedding is a lookup, never counted."""
    frozen = [p for name, p in model.named_parameters() if not p.requires_grad and p.dim() == 2 and "tok_embeddings" not in name]
    return spec.flops_per_token(model, seq_len) - 2.0 * sum(p.numel() for p in frozen)


def parallelizer(spec, dims: ParallelDims, settings: ParallelizeSettings) -> Callable[[nn.Module], nn.Module]:
    """model -> the model parallelized with the family's TP plan (a whole model, or a pipeline stage)."""
    return functools.partial(parallelize_decoder, dims=dims, settings=settings, apply_tp=spec.apply_tp)


def build_model(cfg: JobConfig, spec, args, dims: ParallelDims, device: torch.device, loss_fn):
    """Meta-device model -> (this rank's pipeline stages) -> parallelize -> allocate only this rank's
    shards -> initialise them. Returns the model, its size and FLOPs, and the Pipeline (None without PP)."""
    model = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    num_params = model.num_params()
    flops_per_token = model_flops_per_token(spec, model, cfg.training.seq_len)
    parallelize = parallelizer(spec, dims, ParallelizeSettings.of(cfg))
    if dims.pp_enabled:
        model, pipeline = build_pipeline(model, dims, cfg.parallelism, cfg.training.local_batch_size, cfg.job.seed,
                                         parallelize, device, loss_fn)
        return model, num_params, flops_per_token, pipeline
    model = parallelize(model)
    model.to_empty(device=device)
    if dims.tp_enabled:
        place_grads_like_params(model)
    model.init_weights(seed=cfg.job.seed)
    init_lora(model, cfg.job.seed)
    model.train()
    return model, num_params, flops_per_token, None
