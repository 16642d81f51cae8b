"""The generation and evaluation run: build.py's Run for the job, as the trainer builds it, with only the model's
weights loaded by checkpoint/weights.py (load_trained_weights: generate.checkpoint, else the checkpoint a
resume would take, else checkpoint.initial_load_path or the model.hf_assets_path folder), in eval mode.

One process holds the whole model; under torchrun the ranks shard it with FSDP/HSDP (data-parallel layouts only:
tensor, pipeline, context and expert parallelism are refused in one sentence). The in-loop evaluator (eval_loop.py)
takes the trainer's live Run instead.
"""

import dataclasses
from pathlib import Path

from titanlite.build import Run, build_run
from titanlite.checkpoint.folders import is_complete
from titanlite.checkpoint.weights import ModelIdentity, load_trained_weights
from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.parallel.dist import DistInfo

MODEL_PARALLEL_KEYS = ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                       "expert_parallel_degree")


def check_data_parallel_only(cfg: JobConfig) -> None:
    """Generation and lm-eval run whole-model forwards on every rank (FSDP's all-gathers are fine)."""
    for key in MODEL_PARALLEL_KEYS:
        if getattr(cfg.parallelism, key) > 1:
            raise UserError(f"parallelism.{key} is {getattr(cfg.parallelism, key)}, but generation and lm-eval run on "
                            f"data-parallel layouts only (FSDP/HSDP shard the weights); set parallelism.{key} 1")


def inference_config(cfg: JobConfig) -> JobConfig:
    """The job as generation reads it: training.seq_len is the training window, which generation does not use
    (only the model's context bounds a prompt), there is no global batch to divide, nothing is validated, and the
    decoding loop's changing shapes are run eagerly."""
    return dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, seq_len=1, global_batch_size=-1),
        validation=dataclasses.replace(cfg.validation, enable=False), compile=dataclasses.replace(cfg.compile, enable=False))


def chosen_step_folder(cfg: JobConfig) -> Path | None:
    """generate.checkpoint, which must be a complete step folder; None lets the manager choose as a resume would."""
    if not cfg.generate.checkpoint:
        return None
    path = Path(cfg.generate.checkpoint)
    if not is_complete(path):
        raise UserError(f"generate.checkpoint {path} is not a complete DCP checkpoint (no .metadata in it); "
                        "point it at a step-N folder of a run's checkpoint folder")
    return path


def build_inference_run(cfg: JobConfig, info: DistInfo) -> Run:
    """The job's Run with its weights, in eval mode."""
    check_data_parallel_only(cfg)
    run = build_run(inference_config(cfg), info)
    identity = ModelIdentity(run.label, run.spec.hf_adapter, run.args)
    source = load_trained_weights(run.model, identity, cfg.checkpoint, cfg.job.dump_folder, chosen_step_folder(cfg),
                                  "generate.checkpoint")
    logger.info(f"loaded {run.label} from {source}")
    run.model.eval()
    return run
