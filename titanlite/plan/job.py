"""Plan one job: its mesh on the [plan] hardware, every rank role's memory, the step's speed, and,
when it does not fit, the change that makes it fit at the best predicted speed."""

import dataclasses
from dataclasses import dataclass

import torch

from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.models import get_model_spec
from titanlite.plan.activations import activations
from titanlite.plan.fake_world import fake_world, planned_dims, sharded_model, state_bytes
from titanlite.plan.hardware import FABRIC_GBPS, GPUS
from titanlite.plan.memory import Memory, fsdp_buffers, plan_memory
from titanlite.plan.speed import Speed, plan_speed
from titanlite.parallel.tp import check_tensor_parallel


@dataclass(frozen=True)
class JobPlan:
    role: str  # the ranks this memory is of (all ranks until pipeline stages differ)
    world_size: int
    mesh: str
    memory: Memory
    speed: Speed


def model_args(cfg: JobConfig, spec):
    """The trainer's resolve_model_args; the tokenizer is read only where the flavor leaves the vocab open."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.train import resolve_model_args

    vocab = spec.flavors[cfg.model.flavor].vocab_size if cfg.model.flavor in spec.flavors else -1
    return resolve_model_args(cfg, spec, vocab if vocab > 0 else build_tokenizer(cfg.model).vocab_size)


def stage_model(model, stage: int, stages: int):
    """The model a pipeline stage holds; with one stage, all of it. (Pipeline splitting lands with
    parallel/pp.py; each role then plans its own stage's blocks.)"""
    return model


def plan_state(cfg: JobConfig, world: int) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on rank 0 (the largest shard) of a world of `world`."""
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    dims = planned_dims(cfg, world)
    with fake_world(world):
        dims.build_mesh("cpu")
        return state_bytes(stage_model(sharded_model(cfg, spec, args, dims), 0, dims.pp), cfg.optimizer.name)


def plan_job(cfg: JobConfig) -> JobPlan:
    """The whole plan on the [plan] hardware, from the config alone."""
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    world = cfg.plan.nodes * cfg.plan.gpus_per_node
    dims = planned_dims(cfg, world)
    if dims.tp_enabled or cfg.parallelism.enable_async_tensor_parallel:
        check_tensor_parallel(cfg.parallelism, "cuda", cfg.compile.enable, cfg.float8.enable)
    return predict(cfg, spec, args, dims, plan_state(cfg, world))


def predict(cfg: JobConfig, spec, args, dims, state: dict[str, int]) -> JobPlan:
    """Memory and speed of a job whose per-rank state is known (planned, or counted by the trainer)."""
    from titanlite.train import grad_accumulation_steps

    plan = cfg.plan
    gpu = GPUS[plan.gpu]
    with torch.device("meta"):
        whole = spec.model_cls(args)
    acts = activations(cfg, spec, args, dims)
    memory = plan_memory(cfg, state, acts, fsdp_buffers(cfg, whole, dims), gpu.memory_gib)
    intra = plan.intra_node_gbps if plan.intra_node_gbps > 0 else gpu.link_gbps
    inter = plan.inter_node_gbps if plan.inter_node_gbps > 0 else FABRIC_GBPS[plan.fabric]
    block = max(sum(p.numel() for p in b.parameters()) for b in whole.layers.values())
    speed = plan_speed(cfg, gpu, dims, args, spec.flops_per_token(whole, cfg.training.seq_len), block,
                       whole.num_params(), grad_accumulation_steps(cfg.training, dims.dp_degree), intra, inter,
                       plan.gpus_per_node)
    mesh = f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x tp {dims.tp}, pp {dims.pp}"
    return JobPlan("every rank", dims.dp_degree * dims.model_parallel_degree, mesh, memory, speed)


def changes_to_try(cfg: JobConfig) -> list[tuple[str, JobConfig]]:
    """Single changes that lower memory, each as (the flags that make it, the changed config)."""
    replace = dataclasses.replace
    ac, par, training = cfg.activation_checkpoint, cfg.parallelism, cfg.training
    tries = []
    if ac.mode == "none":
        tries.append(("--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
                      replace(cfg, activation_checkpoint=replace(ac, mode="selective", selective_ac_option="op"))))
    if ac.mode != "full":
        tries.append(("--activation_checkpoint.mode full", replace(cfg, activation_checkpoint=replace(ac, mode="full"))))
    if training.local_batch_size > 1:
        world = cfg.plan.nodes * cfg.plan.gpus_per_node
        dp = world // (par.tensor_parallel_degree * par.pipeline_parallel_degree)
        global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp
        half = training.local_batch_size // 2
        tries.append((f"--training.local_batch_size {half} --training.global_batch_size {global_batch}",
                      replace(cfg, training=replace(training, local_batch_size=half, global_batch_size=global_batch))))
    tp = par.tensor_parallel_degree * 2
    if tp <= cfg.plan.gpus_per_node and not cfg.float8.enable:
        tries.append((f"--parallelism.tensor_parallel_degree {tp}",
                      replace(cfg, parallelism=replace(par, tensor_parallel_degree=tp))))
    if not par.fsdp_cpu_offload:
        tries.append(("--parallelism.fsdp_cpu_offload", replace(cfg, parallelism=replace(par, fsdp_cpu_offload=True))))
    return tries


def cheapest_fix(cfg: JobConfig) -> tuple[str, JobPlan] | None:
    """Of the single changes that make the job fit, the one with the best predicted speed."""
    fitting = []
    for flags, changed in changes_to_try(cfg):
        try:
            result = plan_job(changed)
        except UserError:  # a change the model's shapes refuse (e.g. a TP degree) is no fix
            continue
        if result.memory.fits:
            # Offload's CPU optimizer step is not in the speed model: it is the last resort.
            fitting.append(((not changed.parallelism.fsdp_cpu_offload, result.speed.tps), flags, result))
    if not fitting:
        return None
    _, flags, result = max(fitting, key=lambda item: item[0])
    return flags, result
