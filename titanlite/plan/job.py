"""Plan one job: its mesh on the [plan] hardware, every rank role's memory, the step's speed, and,
when it does not fit, the change that makes it fit at the best predicted speed."""

import dataclasses
from dataclasses import dataclass

from titanlite.build import resolve_model_args
from titanlite.config_rules import check_context_parallel
from titanlite.config_sections import JobConfig, LoRA
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import UserError
from titanlite.models import get_model_spec
from titanlite.models.construct import meta_model
from titanlite.objectives import as_sequences, holds_reference_copy
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.pp import layer_split, stage_ids, stages_per_rank
from titanlite.parallel.tp import check_tensor_parallel
from titanlite.plan.activations import activations, middle_stage_transient, per_block_and_ends
from titanlite.plan.fake_world import buildable, fake_world, sharded_model, state_bytes
from titanlite.plan.hardware import FABRIC_GBPS, GPUS
from titanlite.plan.memory import Memory, fsdp_buffers, pipeline_fsdp_buffers, plan_memory
from titanlite.plan.moe import gathered_params
from titanlite.plan.notes import plan_notes
from titanlite.plan.pipeline import Stages, in_flight, last_stage_in_flight, stage_activations
from titanlite.plan.rollout import rollout_memory
from titanlite.plan.speed import Shape, Speed, plan_speed
from titanlite.rl.generator import check_generator_ranks


@dataclass(frozen=True)
class JobPlan:
    roles: list[tuple[str, Memory]]  # (the ranks, their memory): every rank, or under PP each pp rank role
    world_size: int
    mesh: str
    speed: Speed
    notes: list[str]  # plan/notes.py: float8 at this shape, compile and the memory count

    @property
    def memory(self) -> Memory:
        """The role that needs the most: the one that must fit."""
        return max((memory for _, memory in self.roles), key=lambda memory: memory.needs)


def model_args(cfg: JobConfig, spec):
    """The trainer's model args; the tokenizer is read only where the flavor leaves the vocab open."""
    vocab = spec.flavors[cfg.model.flavor].vocab_size if cfg.model.flavor in spec.flavors else -1
    return resolve_model_args(cfg, spec, vocab if vocab > 0 else build_tokenizer(cfg.model).vocab_size)


def rank_stages(cfg: JobConfig, n_layers: int, pp: int, pp_rank: int) -> Stages:
    """The stages pp rank `pp_rank` holds, from pp.py's own split (the whole model without PP)."""
    if pp == 1:
        return Stages(0, [0], n_layers, n_layers, True, True)
    par = cfg.parallelism
    splits = layer_split(n_layers, pp * stages_per_rank(par), par.pipeline_parallel_layers_per_stage)
    ids = stage_ids(pp_rank, pp, len(splits) // pp, par.pipeline_parallel_schedule)
    sizes = [len(splits[s]) for s in ids]
    return Stages(pp_rank, ids, max(sizes), sum(sizes), 0 in ids, len(splits) - 1 in ids)


def held_root_params(whole, stages: Stages) -> list:
    """Parameters outside model.layers that the stages hold: the embedding on the first, the rest on the last."""
    held = [
        module
        for name, module in whole.named_children()
        if name != "layers" and (stages.first if name == "tok_embeddings" else stages.last)
    ]
    return list({id(p): p for module in held for p in module.parameters()}.values())  # tied embeddings count once


def root_params(whole, stages: Stages) -> int:
    return sum(p.numel() for p in held_root_params(whole, stages))


def stage_params(whole, stages: Stages, ep: int) -> tuple[int, int]:
    """Parameters of the rank's stages that FSDP gathers, all and trained (LoRA's frozen base has no
    gradient): its blocks at the largest block's size (an upper bound where blocks differ) and the root
    parameters it holds; under EP a block's E / ep experts only."""
    largest = max(whole.layers.values(), key=lambda b: gathered_params(b, ep))
    root = held_root_params(whole, stages)
    return tuple(
        stages.held * gathered_params(largest, ep, trained)
        + sum(p.numel() for p in root if p.requires_grad or not trained)
        for trained in (False, True)
    )


STATES: dict[str, dict[int, dict[str, int]]] = {}  # plan_states' results in this process: jobs that differ only
# in float8 or async TP (left out of the fake build) or in what no build reads share one (a table of rows, advice)


def plan_states(cfg: JobConfig, world: int) -> dict[int, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state per pp rank role, each on its rank with the
    largest shards (dp and tp rank 0) of a world of `world`: the first and the last pp rank, and any
    other holding more blocks than the first (ZBV's V over uneven stages). The others hold no more than
    the first (no embedding) and no more microbatches in flight (plan/pipeline.py): they are bounded.
    Memoized on everything the build reads."""
    key = repr((cfg.model, cfg.training, cfg.lora, cfg.dpo, cfg.rl, cfg.optimizer.name, buildable(cfg), world))
    if key not in STATES:
        STATES[key] = build_states(cfg, world)
    return STATES[key]


def build_states(cfg: JobConfig, world: int) -> dict[int, dict[str, int]]:
    """plan_states() without its memo."""
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    pp = cfg.parallelism.pipeline_parallel_degree
    held = [rank_stages(cfg, args.n_layers, pp, pp_rank).held for pp_rank in range(pp)]
    states = {}
    for pp_rank in sorted({0, pp - 1} | {r for r in range(pp) if held[r] > held[0]}):
        dims = ParallelDims.from_config(cfg.parallelism, world)
        with fake_world(world, rank=pp_rank * world // pp):  # pp is the mesh's outermost dimension
            dims.build_mesh("cpu")
            states[pp_rank] = state_bytes(sharded_model(cfg, spec, args, dims), cfg.optimizer.name)
            if holds_reference_copy(cfg):  # DPO's frozen reference: built and sharded like the policy, without adapters
                reference = sharded_model(dataclasses.replace(cfg, lora=LoRA()), spec, args, dims)
                states[pp_rank]["reference"] = state_bytes(reference, cfg.optimizer.name)["params"]
    return states


def plan_state(cfg: JobConfig, world: int) -> dict[str, int]:
    """The largest per-rank bytes of each kind, as the trainer's run summary reports them (a max over ranks)."""
    states = plan_states(cfg, world).values()
    return {kind: max(state[kind] for state in states) for kind in ("params", "grads", "optimizer")}


def trainer_world(cfg: JobConfig) -> int:
    """The ranks that train: the [plan]'s GPUs less rl.generator_ranks, which only generate (rl/generator.py)."""
    return cfg.plan.nodes * cfg.plan.gpus_per_node - cfg.rl.generator_ranks


def plan_job(cfg: JobConfig) -> JobPlan:
    """The whole plan on the [plan] hardware, from the config alone."""
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    check_generator_ranks(cfg, cfg.plan.nodes * cfg.plan.gpus_per_node)
    world = trainer_world(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    check_context_parallel(
        cfg.training.seq_len, dims.cp
    )  # load_config checks it too; a changed config (changes_to_try) is not loaded
    if dims.tp_enabled or cfg.parallelism.enable_async_tensor_parallel:
        check_tensor_parallel(cfg.parallelism, "cuda", cfg.compile.enable)
    return predict(cfg, spec, args, dims, plan_states(cfg, world))


def predict(cfg: JobConfig, spec, args, dims, states: dict[int, dict[str, int]]) -> JobPlan:
    """Memory and speed of a job whose per-rank state is known (planned, or counted by the trainer),
    for each pp rank in `states`. DPO's batch keys count pairs: its activations and speed are those of the sequences."""
    cfg = as_sequences(cfg)
    gpu = GPUS[cfg.plan.gpu]
    whole = meta_model(spec, args, cfg.training.param_dtype, cfg.lora)
    block = max(gathered_params(b, dims.ep) for b in whole.layers.values())  # what FSDP gathers of a block
    tallies = (False, True) if cfg.compile.compiles("model") else (False,)  # eager; a compiled step's lower bound
    if dims.pp_enabled:
        # Each in-flight microbatch's activations, measured at the microbatch size and composed per stage.
        microbatch = dataclasses.replace(
            cfg,
            training=dataclasses.replace(
                cfg.training, local_batch_size=cfg.parallelism.pipeline_parallel_microbatch_size
            ),
        )
        pieces = [
            (
                *per_block_and_ends(microbatch, spec, args, dims, compiled),
                middle_stage_transient(microbatch, spec, args, dims, compiled),
            )
            for compiled in tallies
        ]
    else:
        whole_model = [activations(cfg, spec, args, dims, compiled) for compiled in tallies]
    rollout = rollout_memory(cfg, Shape.of(whole, cfg.training.seq_len, 0.0), dims)
    roles = []
    for pp_rank, state in states.items():
        stages = rank_stages(cfg, args.n_layers, dims.pp, pp_rank)
        acts = (
            [
                stage_activations(
                    per_block,
                    ends,
                    transient,
                    stages,
                    in_flight(cfg, dims.pp, pp_rank),
                    last_stage_in_flight(cfg, dims.pp),
                )
                for per_block, ends, transient in pieces
            ]
            if dims.pp_enabled
            else whole_model
        )
        buffers = (
            pipeline_fsdp_buffers(cfg, *stage_params(whole, stages, dims.ep), dims)
            if dims.pp_enabled
            else fsdp_buffers(cfg, block, root_params(whole, stages), dims)
        )
        memory = plan_memory(
            cfg,
            state,
            acts[0],
            buffers,
            gpu.memory_gib,
            acts[1] if len(acts) > 1 else None,
            rollout.total if rollout is not None else 0,
        )
        roles.append(
            (stages.name if dims.pp_enabled else "every trainer" if cfg.rl.generator_ranks else "every rank", memory)
        )
    mesh = dims.layout
    return JobPlan(
        roles,
        dims.dp_degree * dims.batch_sharing_degree,
        mesh,
        job_speed(cfg, spec, whole, dims, states),
        plan_notes(cfg, args.dim, gpu),
    )


def job_speed(cfg: JobConfig, spec, whole, dims, states: dict[int, dict[str, int]]) -> Speed:
    """The step's speed on the [plan] hardware (`whole`: the unsharded model on meta)."""
    plan = cfg.plan
    gpu = GPUS[plan.gpu]
    intra = plan.intra_node_gbps if plan.intra_node_gbps > 0 else gpu.link_gbps
    inter = plan.inter_node_gbps if plan.inter_node_gbps > 0 else FABRIC_GBPS[plan.fabric]
    shape = Shape.of(whole, cfg.training.seq_len, spec.flops_per_token(whole, cfg.training.seq_len))
    state = max(sum(role.values()) for role in states.values())
    return plan_speed(cfg, gpu, dims, shape, state, intra, inter, plan.gpus_per_node)


def changes_to_try(cfg: JobConfig) -> list[tuple[str, JobConfig]]:
    """Single changes that lower memory, each as (the flags that make it, the changed config)."""
    replace = dataclasses.replace
    ac, par, training = cfg.activation_checkpoint, cfg.parallelism, cfg.training
    tries = []
    if ac.mode == "none":
        tries.append(
            (
                "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
                replace(cfg, activation_checkpoint=replace(ac, mode="selective", selective_ac_option="op")),
            )
        )
    if ac.mode != "full":
        tries.append(
            ("--activation_checkpoint.mode full", replace(cfg, activation_checkpoint=replace(ac, mode="full")))
        )
    dp = ParallelDims.from_config(par, trainer_world(cfg)).dp_degree  # the ranks reading their own batches
    global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp
    if training.local_batch_size > 1:
        half = training.local_batch_size // 2
        tries.append(
            (
                f"--training.local_batch_size {half} --training.global_batch_size {global_batch}",
                replace(cfg, training=replace(training, local_batch_size=half, global_batch_size=global_batch)),
            )
        )
    tp = par.tensor_parallel_degree * 2
    if tp <= cfg.plan.gpus_per_node:
        tries.append(
            (
                f"--parallelism.tensor_parallel_degree {tp}",
                replace(cfg, parallelism=replace(par, tensor_parallel_degree=tp)),
            )
        )
    if par.data_parallel_shard_degree == -1:  # twice the cp ranks from the shard ranks, the global batch kept
        cp = par.context_parallel_degree * 2
        tries.append(
            (
                f"--parallelism.context_parallel_degree {cp} --training.global_batch_size {global_batch}",
                replace(
                    cfg,
                    parallelism=replace(par, context_parallel_degree=cp),
                    training=replace(training, global_batch_size=global_batch),
                ),
            )
        )
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
