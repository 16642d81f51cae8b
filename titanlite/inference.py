"""The model generation and evaluation run: built as the trainer builds it, on one process, with its
weights found as training finds them (a run's DCP checkpoint, else checkpoint.initial_load_path or the
model.hf_assets_path folder), in eval mode.

One process holds the whole model: generate and eval refuse a sharded layout (parallelism degrees
above 1) in one sentence. The in-loop evaluator (eval_loop.py) takes the trainer's live model instead.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanlite.build import meta_model, model_label, resolve_model_args
from titanlite.checkpoint.fit import check_model_fits, load_in_place, newest_resumable, read_metadata
from titanlite.checkpoint.folders import is_complete, list_steps, step_folder
from titanlite.checkpoint.hf_io import load_model_from_hf
from titanlite.config_sections import JobConfig
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.lora import has_lora, init_lora
from titanlite.models import get_model_spec
from titanlite.parallel.dist import choose_device_type

SHARDING_KEYS = ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                 "context_parallel_degree", "expert_parallel_degree")


@dataclass(frozen=True)
class InferenceModel:
    """What generation and evaluation need of a built run: the model (eval mode), its tokenizer, its args
    (max_seq_len, sliding_window) and its name for messages."""

    model: nn.Module
    tokenizer: object
    args: object
    label: str
    device: torch.device


def check_one_process(cfg: JobConfig) -> None:
    """Generation and lm-eval run the whole model in one process."""
    par = cfg.parallelism
    for key in SHARDING_KEYS:
        if getattr(par, key, 1) > 1:
            raise UserError(f"parallelism.{key} is {getattr(par, key)}, but generation and lm-eval run the whole model "
                            f"in one process; set parallelism.{key} 1")
    if par.data_parallel_shard_degree not in (-1, 1):
        raise UserError(f"parallelism.data_parallel_shard_degree is {par.data_parallel_shard_degree}, but generation and "
                        "lm-eval run the whole model in one process; set it to 1")


def inference_device(cfg: JobConfig) -> torch.device:
    """job.device for one process: the first GPU where CUDA is chosen."""
    gpus = torch.cuda.device_count() if cfg.job.device != "cpu" else 0
    return torch.device(choose_device_type(cfg.job.device, gpus, 0, 1))


def build_inference_model(cfg: JobConfig, device: torch.device) -> InferenceModel:
    """The job's model on `device` in training.param_dtype with its weights (load_weights), in eval mode. The
    one place generate and eval build a model; titanlite.build's Run will take its place."""
    check_one_process(cfg)
    tokenizer = build_tokenizer(cfg.model)
    spec = get_model_spec(cfg.model.name)
    # training.seq_len is the training window, which generation does not use: only the context bounds it.
    untrained = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_len=1))
    args = resolve_model_args(untrained, spec, tokenizer.vocab_size)
    model = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.job.seed)
    init_lora(model, cfg.job.seed)
    label = model_label(cfg.model)
    load_weights(model, cfg, spec, args, label)
    return InferenceModel(model.eval(), tokenizer, args, label, device)


def chosen_checkpoint(cfg: JobConfig) -> Path | None:
    """generate.checkpoint, else (checkpoint.enable) checkpoint.load_step's or the newest complete step folder."""
    if cfg.generate.checkpoint:
        path = Path(cfg.generate.checkpoint)
        if not is_complete(path):
            raise UserError(f"generate.checkpoint {path} is not a complete DCP checkpoint (no .metadata in it); "
                            "point it at a step-N folder of a run's checkpoint folder")
        return path
    if not cfg.checkpoint.enable:
        return None
    root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    complete, _ = list_steps(root) if root.is_dir() else ([], [])
    if cfg.checkpoint.load_step != -1:
        if cfg.checkpoint.load_step not in complete:
            raise UserError(f"checkpoint.load_step {cfg.checkpoint.load_step}: there is no complete checkpoint "
                            f"{step_folder(root, cfg.checkpoint.load_step)}; pick one of {complete or 'none'}")
        return step_folder(root, cfg.checkpoint.load_step)
    step = newest_resumable(root, complete)
    return None if step is None else step_folder(root, step)


def load_dcp_model(model: nn.Module, path: Path, label: str, strict: bool) -> None:
    """The model's tensors of the DCP checkpoint at `path` (a whole run's or a model-only export), which must fit it."""
    state = model.state_dict()
    if strict:
        check_model_fits(read_metadata(path), {fqn: tuple(t.shape) for fqn, t in state.items()}, path, label)
    else:  # LoRA: the run's checkpoints hold only the adapters
        saved = read_metadata(path).state_dict_metadata
        state = {fqn: t for fqn, t in state.items() if fqn in saved}
    load_in_place(path, state)
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))


def load_weights(model: nn.Module, cfg: JobConfig, spec, args, label: str) -> None:
    """The weights training would resume from (chosen_checkpoint), else those it would start from
    (checkpoint.initial_load_path, a Hugging Face folder or a DCP checkpoint); none is an error, since
    generating from freshly initialised weights is never what a user means."""
    checkpoint = chosen_checkpoint(cfg)
    lora = has_lora(model)
    initial = cfg.checkpoint.initial_load_path
    if checkpoint is None or lora:
        if initial and cfg.checkpoint.initial_load_in_hf:
            load_model_from_hf(model.state_dict(), Path(initial), spec.hf_adapter, args, label)
        elif initial:
            load_dcp_model(model, Path(initial), label, strict=not lora)
        elif checkpoint is None:
            raise UserError("there are no weights to load: set generate.checkpoint to a step folder, model.hf_assets_path to "
                            "a Hugging Face model folder, or checkpoint.enable true with the run's job.dump_folder")
    if checkpoint is not None:
        load_dcp_model(model, checkpoint, label, strict=not lora)
    logger.info(f"loaded {label} from {checkpoint or initial}")
