"""The sections of how a job runs and is watched: [parallelism], [metrics], [checkpoint], [activation_checkpoint],
[compile], [float8], [profiling], [validation], [plan]."""

from dataclasses import dataclass

from titanlite.config_sections.options import opt


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "replicas of the model (HSDP when above 1 together with sharding)", at_least=1
    )
    data_parallel_shard_degree: int = opt(
        -1, "ranks each replica is sharded over by FSDP; -1 = the rest of the world", at_least=1, sentinels=(-1,)
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "free gathered params after forward: default (yes, except the root), always, never (ZeRO-2-like)",
        choices=("default", "always", "never"),
    )
    fsdp_cpu_offload: bool = opt(
        False,
        "keep FSDP's sharded params, grads and optimizer state in CPU memory; the optimizer steps on the CPU (needs "
        "FSDP)",
    )
    expert_parallel_degree: int = opt(
        1,
        "expert parallel degree (MoE models): the routed experts are split evenly over this many of the "
        "data_parallel_shard_degree ranks, which send each token to its experts' ranks with all-to-all; the expert "
        "weights are FSDP-sharded over the remaining data_parallel_shard_degree / expert_parallel_degree ranks, the "
        "router and shared experts are ordinary FSDP layers; with tensor_parallel_degree above 1 the experts are split "
        "over expert_parallel_degree x tensor_parallel_degree ranks (whole experts each); must divide "
        "data_parallel_shard_degree, and times tensor_parallel_degree the experts",
        at_least=1,
    )
    tensor_parallel_degree: int = opt(
        1,
        "tensor + sequence parallel degree: ranks (innermost, i.e. within a node) that split every matmul; must divide "
        "heads, kv heads, FFN hidden size, vocab and experts",
        at_least=1,
    )
    disable_loss_parallel: bool = opt(
        False,
        "under tensor parallelism, gather the full-vocabulary logits before the loss instead of computing it on vocab "
        "shards (debugging)",
    )
    enable_async_tensor_parallel: bool = opt(
        False, "torch's async TP: all-gather/reduce-scatter micro-pipelined with the matmuls (needs CUDA and compile)"
    )
    pipeline_parallel_degree: int = opt(
        1,
        "pipeline parallel degree: ranks (outermost, i.e. across nodes) that each hold a share of model.layers and "
        "pass activations on",
        at_least=1,
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "the order microbatches move through the stages (torch.distributed.pipelining): GPipe and 1F1B run one stage "
        "per rank, Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble several",
        choices=("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "sequences per pipeline microbatch; must divide training.local_batch_size", at_least=1
    )
    pipeline_parallel_stages_per_rank: int = opt(
        -1,
        "stages each pipeline rank holds (interleaved schedules: 2 or more, ZBVZeroBubble: 2); -1 = 1 for GPipe/1F1B, "
        "2 for the others",
        at_least=1,
        sentinels=(-1,),
    )
    pipeline_parallel_layers_per_stage: int = opt(
        -1,
        "blocks of model.layers per stage; -1 = the layers spread evenly (earlier stages take one more)",
        at_least=1,
        sentinels=(-1,),
    )
    context_parallel_degree: int = opt(
        1,
        "context parallel degree: ranks that split every sequence (load-balanced chunks for causal attention) and "
        "gather each attention's keys and values from one another; they join FSDP's sharding (weights sharded over "
        "data_parallel_shard_degree x context_parallel_degree); training.seq_len must divide into 2 x this many chunks",
        at_least=1,
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "print and record metrics every this many steps (and at step 1)", at_least=1)
    enable_tensorboard: bool = opt(False, "write TensorBoard scalars")
    save_tb_folder: str = opt(
        "tb", "TensorBoard folder under job.dump_folder; each job writes one run in it, which its resumes continue"
    )
    save_for_all_ranks: bool = opt(
        False,
        "every rank writes its own TensorBoard run (<run>/rank<N>), e.g. to compare memory across pipeline stages; "
        "false = rank 0 only",
    )
    peak_tflops: float = opt(0.0, "peak bf16 dense TFLOP/s of one device for MFU; 0 = look the device up", at_least=0)
    summary_warmup_steps: int = opt(
        5,
        "the end-of-run summary line (steady-state tps, peak memory, data share) leaves out this many first steps",
        at_least=0,
    )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save checkpoints and resume from the newest complete one at start")
    folder: str = opt("checkpoint", "checkpoint folder under job.dump_folder; each save is a step-N folder in it")
    interval: int = opt(500, "save every this many steps (the last step and preemption always save)", at_least=1)
    async_mode: str = opt(
        "disabled",
        "disabled (training waits for the write), async (background threads copy the state to host memory, allocated "
        "at the first save and reused by the later ones, during the next step, whose optimizer step waits for the "
        "copy, then write it), or async_with_pinned_mem (the same, copying into pinned memory on a CUDA stream of its "
        "own; CUDA only)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    keep_latest_k: int = opt(
        0, "keep only the newest k checkpoints, deleting older ones in the background; 0 = keep all", at_least=0
    )
    last_save_model_only: bool = opt(False, "the last step's save holds the model alone, in export_dtype")
    export_dtype: str = opt(
        "float32",
        "dtype of the model in a model-only last save and in a Hugging Face export",
        choices=("float32", "bfloat16"),
    )
    load_step: int = opt(-1, "step to resume from; -1 = the newest complete checkpoint", at_least=0, sentinels=(-1,))
    initial_load_path: str = opt(
        "",
        "DCP checkpoint (or Hugging Face folder, see initial_load_in_hf) to start from when the folder holds no "
        "checkpoint; empty = model.hf_assets_path where that is a model folder (config.json), read in Hugging Face "
        "format",
    )
    initial_load_model_only: bool = opt(
        True, "load only the model from initial_load_path (false: also optimizer, schedule, step and data position)"
    )
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face folder (config.json + safetensors)")
    last_save_in_hf: bool = opt(
        False,
        "also write the final model in Hugging Face format to <folder>/step-N-hf, with the run's tokenizer files (a "
        "folder transformers, vLLM and model.hf_assets_path load); needs enable, which turns every save off",
    )
    create_seed_checkpoint: bool = opt(False, "write the initialised model as <folder>/step-0 on one process and exit")
    allow_unverified: bool = opt(
        False,
        "load a checkpoint that has no checksums folder (written by another tool or a titanlite before checksums, or "
        "the folder lost), without verifying its files; false = refuse it in one sentence",
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "none",
        "recompute activations in backward instead of keeping them: none, full (every block) or selective",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = opt(
        "op",
        "with mode selective: op (keep matmul/attention outputs, recompute the cheap ops) or an integer N (fully "
        "checkpoint every N-th block)",
    )
    offload_activations: bool = opt(
        False,
        "keep the activations saved for backward in CPU memory (pinned on CUDA) until backward needs them; the run "
        "summary says the most it held there; saves nothing on a CPU run",
    )


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the chosen components")
    components: list[str] = opt(
        ["model", "loss"],
        "what to compile: model (each block, fullgraph; under expert parallelism with graph breaks at the token "
        "dispatch), loss",
        choices=("model", "loss"),
    )
    backend: str = opt(
        "inductor", "torch.compile backend: inductor (fast kernels), aot_eager (no codegen, for debugging numerics)"
    )

    def compiles(self, component: str) -> bool:
        """components holds only known names: the config checks them against its choices."""
        return self.enable and component in self.components


@dataclass
class Float8:
    enable: bool = opt(False, "float8 training of Linear layers (torchao, CUDA with compute capability 8.9+)")
    recipe_name: str = opt("tensorwise", "tensorwise or rowwise scaling", choices=("tensorwise", "rowwise"))
    filter_fqns: list[str] = opt(["output"], "Linear layers whose FQN contains one of these stay in high precision")
    enable_fsdp_float8_all_gather: bool = opt(False, "all-gather FSDP params in float8 (tensorwise only)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "compute all float8 scales in one kernel after the optimizer step (needs enable_fsdp_float8_all_gather)"
    )
    emulate: bool = opt(
        False,
        "tests only: torchao casts to float8 and back but multiplies in high precision, so float8 runs on CPU (no "
        "speed-up)",
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(
        False, "record torch.profiler traces (Perfetto/TensorBoard) of one step in every profile_freq"
    )
    save_traces_folder: str = opt(
        "profile_traces", "trace folder under job.dump_folder: iteration_<step>/rank<r>_trace.json"
    )
    profile_freq: int = opt(10, "profile (and snapshot memory) every this many steps", at_least=1)
    enable_memory_snapshot: bool = opt(
        False, "record CUDA memory snapshots every profile_freq steps and on out-of-memory (CUDA only)"
    )
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder under job.dump_folder")


@dataclass
class Validation:
    enable: bool = opt(False, "compute loss and perplexity on held-out data every validation.freq steps")
    freq: int = opt(100, "validate every this many steps", at_least=1)
    steps: int = opt(
        10,
        "at most this many batches per rank per validation, always from the start of the data; -1 = one whole pass",
        at_least=1,
        sentinels=(-1,),
    )
    dataset: str = opt(
        "sample_val",
        "sample_val (the held-out part of the sample corpus), c4_val (allenai/c4 validation split), or local (files at "
        "dataset_path)",
    )
    dataset_path: str = opt(
        "",
        "file or folder of held-out local data or a token store, read like training.dataset_path (chat data in "
        "training.dataset_format); setting it means dataset = local",
    )
    local_batch_size: int = opt(
        -1, "sequences per rank per validation batch; -1 = training.local_batch_size", at_least=1, sentinels=(-1,)
    )
    seq_len: int = opt(-1, "tokens per validation sequence; -1 = training.seq_len", at_least=1, sentinels=(-1,))


@dataclass
class Plan:
    gpu: str = opt(
        "H100 SXM",
        "GPU the job is planned for (python -m titanlite.plan; titanlite/plan/hardware.py has their memory, peaks and "
        "links)",
        choices=("A100 40GB", "A100 80GB", "H100 SXM", "H100 PCIe", "H100 96GB 500W", "H200", "B200", "GB200"),
    )
    nodes: int = opt(1, "nodes the job runs on", at_least=1)
    gpus_per_node: int = opt(8, "GPUs (ranks) per node; the world size is nodes x gpus_per_node", at_least=1)
    fabric: str = opt(
        "infiniband_ndr",
        "inter-node network: infiniband_ndr (400 Gb/s per GPU) or efa_p5 (AWS p5: 3200 Gb/s per node)",
        choices=("infiniband_ndr", "efa_p5"),
    )
    intra_node_gbps: float = opt(
        -1.0,
        "GB/s per GPU within a node for collectives; -1 = the GPU's NVLink (or PCIe) figure",
        above=0,
        sentinels=(-1,),
    )
    inter_node_gbps: float = opt(
        -1.0, "GB/s per GPU between nodes for collectives; -1 = the fabric's figure", above=0, sentinels=(-1,)
    )
