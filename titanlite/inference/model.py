"""The model generation and evaluation run: the [model] section's model (models/construct.py's model_args, meta_model,
parallelizer, materialize), sharded over the data-parallel ranks as the [parallelism] section says, with only its
weights loaded, in eval mode. It stops before the loss: no training window, global batch, validation, optimizer,
data loader or DPO reference is built or checked.

The weights come as training finds them, through the one checked loader (checkpoint/weights.py's
load_trained_weights: checksums, shapes and the model family; generate.checkpoint, else the checkpoint a resume would
take, else checkpoint.initial_load_path or the model.hf_assets_path folder). One process holds the
whole model; under torchrun the ranks shard it with FSDP/HSDP (data-parallel layouts only: tensor, pipeline,
context and expert parallelism are refused in one sentence). The caller opens and closes the process group.

`InferenceModel` has the fields of build.py's Run that generation and lm-eval read (cfg, info, model, tokenizer,
args), so the in-loop evaluator takes the trainer's live Run in its place.
"""

import dataclasses
from pathlib import Path

import torch
from torch import nn

from titanlite.checkpoint.weights import ModelIdentity, load_trained_weights
from titanlite.config_sections import Compile, JobConfig
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models import ModelSpec, get_model_spec
from titanlite.models.construct import materialize, meta_model, model_args, parallelizer, seed_everything
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.dist import DistInfo
from titanlite.parallel.parallelize import ParallelizeSettings
from titanlite.run import model_label

MODEL_PARALLEL_KEYS = (
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
)


@dataclasses.dataclass(frozen=True)
class InferenceModel:
    """A model with its weights, ready to generate or score: what build.py's Run holds for the same job, less
    everything training adds."""

    cfg: JobConfig
    info: DistInfo  # this process: rank, world size, device
    args: object  # the family's model args (models/construct.py's model_args)
    tokenizer: object
    model: nn.Module  # in eval mode

    @property
    def device(self) -> torch.device:
        return self.info.device


def check_data_parallel_only(cfg: JobConfig) -> None:
    """Generation and lm-eval run whole-model forwards on every rank (FSDP's all-gathers are fine)."""
    for key in MODEL_PARALLEL_KEYS:
        if getattr(cfg.parallelism, key) > 1:
            raise UserError(
                f"parallelism.{key} is {getattr(cfg.parallelism, key)}, but generation and lm-eval run on "
                f"data-parallel layouts only (FSDP/HSDP shard the weights); set parallelism.{key} 1"
            )


def sharded_model(cfg: JobConfig, spec: ModelSpec, args, dims: ParallelDims, device: torch.device) -> nn.Module:
    """The model allocated on the device, this rank's shards only, initialised from job.seed (its weights are loaded
    next). The decoding loop's changing shapes run eagerly: compile is left off."""
    settings = dataclasses.replace(ParallelizeSettings.of(cfg), compile=Compile())
    model = parallelizer(spec, dims, settings)(meta_model(spec, args, cfg.training.param_dtype, cfg.lora))
    return materialize(model, cfg.job.seed, device, dims.tp_enabled)


def build_inference_model(
    cfg: JobConfig, info: DistInfo, checkpoint_key: str = "generate.checkpoint"
) -> InferenceModel:
    """The job's model with its weights, in eval mode, on the process group the caller opened; checkpoint_key: how the
    command names generate.checkpoint (python -m titanlite.eval: --model_args checkpoint)."""
    check_data_parallel_only(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, info.world_size)
    dims.build_mesh(info.device.type)
    seed_everything(cfg.job.seed, cfg.training.deterministic)
    tokenizer = build_tokenizer(cfg.model)
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg.model, spec, tokenizer.vocab_size)
    model, label = sharded_model(cfg, spec, args, dims, info.device), model_label(cfg.model)
    source = load_trained_weights(
        model,
        ModelIdentity(label, spec.hf_adapter, args),
        cfg.checkpoint,
        cfg.job.dump_folder,
        Path(cfg.generate.checkpoint) if cfg.generate.checkpoint else None,
        checkpoint_key,
    )
    logger.info(f"loaded {label} from {source}")
    return InferenceModel(cfg, info, args, tokenizer, model.eval())
