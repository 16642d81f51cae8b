"""Rules between the keys of how a job trains and runs: training, data, model, parallelism, checkpoints, LoRA,
optimizers, fault tolerance, evaluation."""

from titanlite.config_sections import JobConfig
from titanlite.errors import UserError


def check_training(cfg: JobConfig) -> None:
    training = cfg.training
    if training.on_nonfinite == "stop" and training.max_nonfinite_skips != type(training)().max_nonfinite_skips:
        raise UserError(
            f"training.max_nonfinite_skips {training.max_nonfinite_skips} counts skipped steps, but "
            "training.on_nonfinite "
            "stop never skips one (the first NaN or inf stops the run); set training.on_nonfinite skip, or leave "
            "max_nonfinite_skips at its default"
        )
    if training.on_nonfinite == "skip" and training.skip_nan_check:
        raise UserError(
            "training.on_nonfinite skip checks every step for NaN or inf, but training.skip_nan_check true turns the "
            "check off; set training.skip_nan_check false"
        )
    if training.param_dtype == "bfloat16" and training.mixed_precision_param != "bfloat16":
        raise UserError(
            "training.param_dtype bfloat16 stores bf16 weights, which compute in bf16; set "
            "training.mixed_precision_param bfloat16 too"
        )


def check_dataset_format(cfg: JobConfig) -> None:
    """Chat and prompt/completion data are local records (or a chat store made from them) with labels left out
    of the loss, which the chunked loss (a mean over every label) does not skip; a mix holds no loss mask."""
    training = cfg.training
    fmt = training.dataset_format
    if fmt in ("text", "preference") and not training.packing:
        raise UserError(
            f"training.packing false applies to training.dataset_format chat or prompt_completion, not {fmt}; "
            "leave training.packing at true"
        )
    if fmt == "text":
        if training.train_on != "assistant" or training.chat_template:
            raise UserError(
                "training.train_on and training.chat_template apply to training.dataset_format chat or "
                "prompt_completion; set the format or leave them at their defaults"
            )
        return
    if fmt == "preference" and training.train_on != "assistant":
        raise UserError(
            f"training.train_on {training.train_on} does not apply to training.dataset_format preference, which "
            "trains each pair's completion; leave training.train_on at assistant"
        )
    if fmt in ("chat", "prompt_completion") and cfg.model.attention_mask != "block_causal":
        raise UserError(
            f"training.dataset_format {fmt} packs several conversations into a window, which must not attend "
            "to each other; set model.attention_mask block_causal"
        )
    if training.loss_chunk_tokens:
        raise UserError(
            f"training.dataset_format {fmt} leaves untrained tokens out of the loss, which the chunked loss "
            "does not do yet; set training.loss_chunk_tokens 0"
        )
    if training.dataset_mix or not training.dataset_path:
        raise UserError(
            f"training.dataset_format {fmt} reads local jsonl/json/parquet records or a chat store; set "
            "training.dataset_path to them (not training.dataset_mix)"
        )


def check_loss_chunking(cfg: JobConfig) -> None:
    """The chunked loss runs inside the model's forward (the last pipeline stage's); tensor parallelism
    computes the loss on vocab shards, and it multiplies by the output weight itself, which float8 must
    leave in high precision."""
    chunk, par = cfg.training.loss_chunk_tokens, cfg.parallelism
    if chunk and cfg.float8.enable and not any(name in "output" for name in cfg.float8.filter_fqns):
        raise UserError(
            f"training.loss_chunk_tokens {chunk} multiplies by the output weight in the compute dtype, but "
            f"float8.filter_fqns {','.join(cfg.float8.filter_fqns) or '(empty)'} lets float8 convert the output layer; "
            "add output to float8.filter_fqns or set training.loss_chunk_tokens 0"
        )
    if chunk and par.tensor_parallel_degree > 1:
        raise UserError(
            f"training.loss_chunk_tokens {chunk} is not supported with parallelism.tensor_parallel_degree "
            f"{par.tensor_parallel_degree} yet (the output projection is vocab-sharded there, with loss parallel); "
            "set training.loss_chunk_tokens 0"
        )


def check_model(cfg: JobConfig) -> None:
    if cfg.model.reset_position_ids and cfg.model.attention_mask != "block_causal":
        raise UserError(
            "model.reset_position_ids restarts positions at each document, which needs model.attention_mask "
            f"block_causal (got {cfg.model.attention_mask}); set model.attention_mask block_causal or "
            "reset_position_ids false"
        )


def check_activation_checkpoint(cfg: JobConfig) -> None:
    # Checked whatever the mode: a value that means nothing is a typo, not something to ignore.
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise UserError(
            "activation_checkpoint.selective_ac_option must be op or a positive integer N (checkpoint every N-th "
            f"block); got {option!r}"
        )


SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")  # one stage per rank; the other schedules hold several


def check_context_parallel(seq_len: int, cp: int, key: str = "training.seq_len") -> None:
    """The window (`key`'s length) must cut into 2 x cp equal chunks (parallel/cp.py); validation and the
    planner's changed configs check theirs too."""
    if cp > 1 and seq_len % (2 * cp):
        raise UserError(
            f"{key} {seq_len} does not split into 2 x parallelism.context_parallel_degree {cp} = "
            f"{2 * cp} equal chunks; choose a seq_len divisible by {2 * cp}"
        )


def check_parallelism(cfg: JobConfig) -> None:
    par = cfg.parallelism
    schedule, per_rank = par.pipeline_parallel_schedule, par.pipeline_parallel_stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank > 1:
        raise UserError(
            f"parallelism.pipeline_parallel_schedule {schedule} runs one stage per rank, but "
            "pipeline_parallel_stages_per_rank "
            f"is {per_rank}; set it to 1 or choose Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble"
        )
    if schedule == "ZBVZeroBubble" and per_rank not in (-1, 2):
        raise UserError(
            f"parallelism.pipeline_parallel_schedule ZBVZeroBubble runs exactly 2 stages per rank, not "
            f"pipeline_parallel_stages_per_rank {per_rank}; set it to 2 or -1"
        )
    if par.pipeline_parallel_degree > 1 and cfg.checkpoint.last_save_in_hf:
        raise UserError(
            "checkpoint.last_save_in_hf gathers the whole model on every rank, but a pipeline stage holds only its own "
            "layers; set it to false and convert the last checkpoint with python -m titanlite.convert dcp-to-hf"
        )


def check_checkpoint(cfg: JobConfig) -> None:
    ckpt = cfg.checkpoint
    if ckpt.initial_load_in_hf and not ckpt.initial_load_path:
        raise UserError(
            "checkpoint.initial_load_in_hf is set but checkpoint.initial_load_path is empty; set it to the Hugging "
            "Face folder"
        )
    if ckpt.initial_load_in_hf and not ckpt.initial_load_model_only:
        raise UserError(
            "a Hugging Face folder holds only the model; set checkpoint.initial_load_model_only true with "
            "initial_load_in_hf"
        )


def check_lora(cfg: JobConfig) -> None:
    if cfg.lora.rank and cfg.parallelism.tensor_parallel_degree > 1:
        raise UserError(
            f"lora.rank {cfg.lora.rank} with parallelism.tensor_parallel_degree "
            f"{cfg.parallelism.tensor_parallel_degree} "
            "is not supported yet (the TP plans shard the base weights but not the adapters); set "
            "tensor_parallel_degree 1 (FSDP shards the frozen base over the data-parallel ranks)"
        )
    if cfg.lora.base_dtype == "bfloat16" and (not cfg.lora.rank or cfg.training.mixed_precision_param != "bfloat16"):
        raise UserError(
            "lora.base_dtype bfloat16 keeps LoRA's frozen weights in the dtype they compute in, so it needs "
            "lora.rank above 0 and training.mixed_precision_param bfloat16; set those or lora.base_dtype float32"
        )
    if cfg.lora.rank and cfg.float8.enable:
        raise UserError(
            f"lora.rank {cfg.lora.rank} with float8.enable is not supported yet (float8 would replace the "
            "adapted layers); set float8.enable false"
        )


def check_optimizer(cfg: JobConfig) -> None:
    """Muon's keys mean nothing to another optimizer; Muon gathers each matrix whole on the device it trains on."""
    optimizer = cfg.optimizer
    muon_keys = [
        k
        for k in ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_dtype")
        if getattr(optimizer, k) != getattr(type(optimizer)(), k)
    ]
    if optimizer.name != "Muon" and muon_keys:
        raise UserError(
            f"optimizer.{muon_keys[0]} applies to optimizer.name Muon only; set the name Muon or leave "
            "the muon_ keys at their defaults"
        )
    if optimizer.name == "Muon" and optimizer.implementation != "auto":
        raise UserError(
            f"optimizer.implementation {optimizer.implementation} does not exist for Muon (it steps one "
            "parameter at a time); set it to auto"
        )
    if optimizer.name == "Muon" and cfg.parallelism.fsdp_cpu_offload:
        raise UserError(
            "optimizer.name Muon gathers each matrix's update across the ranks, which the CPU-offloaded "
            "shards of parallelism.fsdp_cpu_offload cannot do; set fsdp_cpu_offload false or use AdamW"
        )


def check_multi_token_prediction(cfg: JobConfig) -> None:
    """MTP (models/deepseek_v3/mtp.py) shifts each whole window's tokens on the rank holding the embedding and the
    output layer, and trains every label; the layouts and data that break one of those are refused."""
    model, par = cfg.model, cfg.parallelism
    if not model.mtp_layers:
        if model.mtp_loss_weight != 0.3:
            raise UserError(
                "model.mtp_loss_weight weighs the multi-token prediction loss; set model.mtp_layers above 0 "
                "or leave the weight at its default"
            )
        return
    if model.name != "deepseek_v3" and not model.hf_assets_path:
        raise UserError(
            f"model.mtp_layers {model.mtp_layers}: model {model.name} has no multi-token prediction "
            "(deepseek_v3 has); set model.mtp_layers 0"
        )
    layouts = {
        "pipeline_parallel_degree": par.pipeline_parallel_degree,
        "context_parallel_degree": par.context_parallel_degree,
        "tensor_parallel_degree": par.tensor_parallel_degree,
        "expert_parallel_degree": par.expert_parallel_degree,
    }
    for key, degree in layouts.items():
        if degree > 1:
            raise UserError(
                f"model.mtp_layers {model.mtp_layers} with parallelism.{key} {degree} is not supported yet "
                f"(the depths run unsharded on whole windows); set {key} 1 or model.mtp_layers 0"
            )
    if cfg.training.dataset_format != "text" or cfg.training.loss_chunk_tokens:
        raise UserError(
            f"model.mtp_layers {model.mtp_layers} trains on every later token of the window, which needs "
            "training.dataset_format text and training.loss_chunk_tokens 0; set those or model.mtp_layers 0"
        )
    if cfg.training.seq_len <= model.mtp_layers + 1:
        raise UserError(
            f"training.seq_len {cfg.training.seq_len} leaves no position for multi-token prediction depth "
            f"{model.mtp_layers}; set seq_len above {model.mtp_layers + 1}"
        )


def check_fault_tolerance(cfg: JobConfig) -> None:
    """Replica groups are numbered 0..group_size-1; inside a group any layout (FSDP, HSDP, TP, PP, CP, EP) has been
    checked against the one-process run."""
    ft = cfg.fault_tolerance
    check_semi_sync(cfg)
    if not ft.enable:
        return
    if ft.replica_id >= ft.group_size:
        raise UserError(
            f"fault_tolerance.replica_id {ft.replica_id} must be below fault_tolerance.group_size {ft.group_size} "
            "(groups are numbered from 0); give each group its own id from 0 to group_size - 1"
        )
    if ft.min_replica_size > ft.group_size:
        raise UserError(
            f"fault_tolerance.min_replica_size {ft.min_replica_size} exceeds fault_tolerance.group_size "
            f"{ft.group_size}, so no step could ever commit; set it to at most {ft.group_size}"
        )
    training = cfg.training
    if training.dataset_format == "text" and not training.dataset_mix and not training.dataset_path:
        raise UserError(
            f"fault_tolerance.enable needs a data position a peer can hand over, which training.dataset "
            f"{training.dataset!r} (a stream read per rank) has not; set training.dataset_path to a token store "
            "from python -m titanlite.data.prepare, or a training.dataset_mix"
        )


DILOCO_KEYS = ("sync_steps", "outer_lr", "outer_momentum")


def check_semi_sync(cfg: JobConfig) -> None:
    """DiLoCo synchronizes every sync_steps optimizer steps; the checkpoints and the last step must fall on a
    synchronization, where every group holds the same (global) weights."""
    ft, default = cfg.fault_tolerance, type(cfg.fault_tolerance)()
    if ft.semi_sync_method != "diloco":
        changed = [key for key in DILOCO_KEYS if getattr(ft, key) != getattr(default, key)]
        if changed:
            raise UserError(
                f"fault_tolerance.{changed[0]} applies to fault_tolerance.semi_sync_method diloco only; set that "
                "method or leave the key at its default"
            )
        return
    if not ft.enable:
        raise UserError(
            "fault_tolerance.semi_sync_method diloco synchronizes replica groups, which needs fault_tolerance.enable "
            "true; enable it or set the method to none"
        )
    if cfg.parallelism.pipeline_parallel_degree > 1:
        raise UserError(
            f"fault_tolerance.semi_sync_method diloco with parallelism.pipeline_parallel_degree "
            f"{cfg.parallelism.pipeline_parallel_degree} is not supported yet (a stage's model is no whole model "
            "to synchronize); set it to 1 or the method to none"
        )
    if cfg.training.epochs:
        raise UserError(
            f"training.epochs {cfg.training.epochs} with fault_tolerance.semi_sync_method diloco is not supported "
            f"(the last step must end a synchronization of fault_tolerance.sync_steps {ft.sync_steps}); set "
            "training.steps to a multiple of it instead"
        )
    ends = {"training.steps": cfg.training.steps}
    if cfg.checkpoint.enable:
        ends["checkpoint.interval"] = cfg.checkpoint.interval
    for key, value in ends.items():
        if value % ft.sync_steps:
            raise UserError(
                f"{key} {value} is not a multiple of fault_tolerance.sync_steps {ft.sync_steps}, so it would fall "
                "between two DiLoCo synchronizations, where the groups' weights differ; make it a multiple"
            )


def check_eval(cfg: JobConfig) -> None:
    ev, par = cfg.eval, cfg.parallelism
    if (ev.interval or ev.at_end) and not ev.tasks and not ev.sample_prompts:
        key = "eval.interval" if ev.interval else "eval.at_end"
        raise UserError(
            f"{key} is set but eval.tasks and eval.sample_prompts are empty; name the lm-eval tasks in eval.tasks "
            "(e.g. hellaswag) or set eval.interval 0"
        )
    if ev.interval or ev.at_end:
        # The evaluator reads whole logits of whole sequences from one forward of the model.
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
            if getattr(par, key) > 1:
                raise UserError(
                    f"in-loop evaluation ([eval]) runs on data-parallel layouts only, but parallelism.{key} is "
                    f"{getattr(par, key)}; set eval.interval 0 and eval.at_end false, and evaluate the checkpoint "
                    "with python -m titanlite.eval"
                )
    if not (ev.interval or ev.at_end) and (ev.tasks or ev.sample_prompts):
        key = "eval.tasks" if ev.tasks else "eval.sample_prompts"
        raise UserError(
            f"{key} is set but eval.interval is 0 and eval.at_end false, so the run would never evaluate; set "
            f"eval.interval N or eval.at_end true, or leave {key} empty"
        )
