"""The job config: one dataclass per TOML section, every field typed, defaulted and documented.

`opt(default, doc, ...)` declares a field; the doc (with its choices or range) becomes its `--help` line.
Every numeric field declares its valid range (at_least/above/at_most/below, sentinels, length), which
the loader checks and a fuzz test (tests/test_config_fuzz.py) requires.
"""

from dataclasses import dataclass, field
from typing import Any


def opt(
    default: Any,
    doc: str,
    *,
    choices: tuple = (),
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    sentinels: tuple = (),
    length: int | None = None,
) -> Any:
    """Declare a field. Numeric ranges (applied to each item of a list field): at_least/at_most
    are inclusive bounds, above/below exclusive; `sentinels` are values allowed outside the range
    (e.g. -1 = "all"); `length` is the required length of a list field."""
    meta = {
        "doc": doc,
        "choices": choices,
        "at_least": at_least,
        "above": above,
        "at_most": at_most,
        "below": below,
        "sentinels": sentinels,
        "length": length,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML file holding this job; CLI flags override its values")
    dump_folder: str = opt(
        "./outputs", "folder for everything the run writes (config, checkpoints, TensorBoard, traces)"
    )
    description: str = opt("", "free text describing the job, logged at start")
    seed: int = opt(
        0,
        "seed for weight init, data order and dropout; the same seed gives the same run",
        at_least=0,
        at_most=2**32 - 1,
    )
    log_rank_files: bool = opt(False, "also write every rank's log, all levels, to <dump_folder>/logs/rank<N>.log")
    init_timeout_seconds: int = opt(
        300,
        "seconds every rank waits for all WORLD_SIZE ranks to join at MASTER_ADDR:MASTER_PORT when started without "
        "torchrun, then stops naming the missing ones",
        at_least=1,
    )
    device: str = opt(
        "auto",
        "auto (CUDA where a GPU is visible, else CPU), cuda (stop if there is none) or cpu (hide the GPUs from the "
        "run; e.g. CPU ranks on a GPU machine)",
        choices=("auto", "cuda", "cpu"),
    )
    hang_timeout_seconds: int = opt(
        -1,
        "a training step (with its log, validation and save) that takes longer than this is a hang: every rank dumps "
        "its Python stacks to its rank log, rank 0 names the ranks that did not finish the step, and the job exits "
        "with code 3 so the scheduler restarts it from the last checkpoint; -1 = max(300, 20 x the steady step time) "
        "(30 minutes until the first steps have run), 0 = off",
        at_least=1,
        sentinels=(-1, 0),
    )


@dataclass
class Model:
    name: str = opt("llama3", "model family from the registry (python -m titanlite.models lists them)")
    flavor: str = opt("debugmodel", "size of the family, e.g. debugmodel, 1B, 8B")
    tokenizer_path: str = opt(
        "",
        "the model's tokenizer.model: tiktoken BPE (Llama 3) or SentencePiece (Llama 2, Mistral, Mixtral), told apart "
        "by its bytes; or a Hugging Face tokenizer.json (tokenizer_config.json beside it); empty = the shipped "
        "assets/tokenizer.model",
    )
    hf_assets_path: str = opt(
        "",
        "Hugging Face folder: with a config.json, the model to start from (its family and every dimension from "
        "config.json, so name, flavor and n_layers need not be set and may not differ; its safetensors weights as "
        "checkpoint.initial_load_path, unless that is set; its tokenizer); without one, a tokenizer folder. The "
        "tokenizer is its tokenizer.json + tokenizer_config.json, or else tokenizer.model, used when tokenizer_path is "
        "empty",
    )
    moe_aux_loss_coeff: float = opt(
        0.01,
        "weight of the MoE router load-balancing loss (1.0 when balanced) added to the training loss; dense models "
        "have none",
        at_least=0,
    )
    moe_bias_update_rate: float = opt(
        1e-3,
        "aux-loss-free balancing of routers with a bias (deepseek_v3): after each optimizer step every expert's "
        "routing bias rises by this much if it got fewer than its block's mean tokens of the global batch, falls if "
        "more (DeepSeek-V3 trained with 0.001); 0 keeps the biases; other models have none",
        at_least=0,
    )
    n_layers: int = opt(
        0,
        "train the flavor with this many blocks instead (e.g. to benchmark a big model's shapes on one GPU); 0 = the "
        "flavor's; checkpoints of another depth are refused",
        at_least=0,
    )
    attention_mask: str = opt(
        "block_causal",
        "block_causal (each token attends only to earlier tokens of its own document, the documents of a packed window "
        "told apart by the tokenizer's bos) or causal (to every earlier token of the window)",
        choices=("block_causal", "causal"),
    )
    reset_position_ids: bool = opt(
        False,
        "positions (RoPE, GPT-2's table) restart at 0 at each document's first token instead of counting from the "
        "window's start (needs attention_mask block_causal; always on for dataset_format chat and prompt_completion)",
    )
    mtp_layers: int = opt(
        0,
        "deepseek_v3 multi-token prediction: depths after the main blocks, depth k predicting the token k + 1 places "
        "ahead with one more block and the shared embedding and output layer (DeepSeek-V3 671B trained with 1); 0 = "
        "off; an HF folder must hold that many (config.json num_nextn_predict_layers)",
        at_least=0,
        at_most=8,
    )
    mtp_loss_weight: float = opt(
        0.3,
        "weight of the multi-token prediction loss (the mean over the depths) added to the training loss (DeepSeek-V3: "
        "0.3 for its first 10T tokens, then 0.1)",
        at_least=0,
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "optimizer; AdamWBF16Kahan keeps bf16 weights and states with Kahan-compensated updates (needs "
        "training.param_dtype bfloat16); Muon orthogonalizes the momentum of the blocks' matrices "
        "(titanlite/optim/muon.py) and runs AdamW on the rest",
        choices=("AdamW", "Adam", "AdamWBF16Kahan", "Muon"),
    )
    lr: float = opt(8e-4, "peak learning rate; 0 keeps the weights as they are", at_least=0)
    betas: list[float] = opt([0.9, 0.95], "Adam betas, comma-separated on the CLI", at_least=0, below=1, length=2)
    eps: float = opt(1e-8, "Adam epsilon", above=0)
    weight_decay: float = opt(0.1, "decoupled weight decay", at_least=0)
    implementation: str = opt(
        "auto",
        "auto = fused on CUDA, foreach elsewhere (AdamWBF16Kahan: one compiled fused kernel per parameter on CUDA, the "
        "same math op by op on the CPU; auto or fused; Muon: auto only, one parameter at a time)",
        choices=("auto", "fused", "foreach", "for-loop"),
    )
    muon_lr: float = opt(
        -1.0,
        "Muon: peak learning rate of the blocks' matrices, whose update is scaled to AdamW's RMS on long runs "
        "(Moonshot); -1 = optimizer.lr, right for long runs of large models; short runs of small models want about "
        "25-30x optimizer.lr (the debug model: 0.02, docs/optimizers.md)",
        at_least=0,
        sentinels=(-1,),
    )
    muon_momentum: float = opt(0.95, "Muon: momentum of the matrices' update", at_least=0, below=1)
    muon_nesterov: bool = opt(
        True, "Muon: Nesterov momentum (the gradient plus momentum times the buffer is orthogonalized)"
    )
    muon_ns_steps: int = opt(
        5, "Muon: Newton-Schulz iterations orthogonalizing each matrix's update", at_least=1, at_most=20
    )
    muon_ns_dtype: str = opt(
        "float32",
        "Muon: dtype of the Newton-Schulz iteration; bfloat16 is faster on GPUs, float32 gives the same result under "
        "every layout",
        choices=("float32", "bfloat16"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "steps of linear warmup from 0 to optimizer.lr", at_least=0)
    decay_type: str = opt("linear", "shape of the decay after warmup", choices=("linear", "cosine", "sqrt"))
    decay_ratio: float = opt(
        -1.0,
        "fraction of the steps spent decaying at the end (warmup-stable-decay); -1 = decay right after warmup",
        at_least=0,
        at_most=1,
        sentinels=(-1,),
    )
    min_lr_factor: float = opt(0.0, "the lr decays to min_lr_factor * optimizer.lr", at_least=0, at_most=1)


@dataclass
class DataSource:
    """One item of training.dataset_mix: a TOML table { path = "...", weight = 0.7 }."""

    path: str = opt(
        "",
        "a token store folder (python -m titanlite.data.prepare) or raw data file or folder, read like "
        "training.dataset_path",
    )
    weight: float = opt(1.0, "its share of the training windows, relative to the other sources' weights", above=0)


@dataclass
class Training:
    local_batch_size: int = opt(
        8, "sequences per rank per micro-step (dataset_format preference: pairs, two sequences each)", at_least=1
    )
    global_batch_size: int = opt(
        -1,
        "sequences (preference pairs) per optimizer step over all ranks; above local x dp means gradient accumulation; "
        "-1 = local x dp",
        at_least=1,
        sentinels=(-1,),
    )
    seq_len: int = opt(2048, "tokens per sequence", at_least=1)
    steps: int = opt(10000, "optimizer steps to train for", at_least=1)
    epochs: float = opt(
        0.0,
        "train this many passes over the data; above 0 it sets training.steps (said at start), for a token store, chat "
        "data or preference pairs, whose epoch length is known at start; 0 = train training.steps",
        at_least=0,
    )
    max_norm: float = opt(1.0, "clip the global gradient norm to this; 0 = no clipping", at_least=0)
    dataset: str = opt(
        "sample",
        "sample (shipped corpus, minus the topics held out as sample_val), c4 (streamed from the Hugging Face hub), "
        "synthetic, or local (files at dataset_path)",
    )
    dataset_path: str = opt(
        "",
        "file or folder of local data (jsonl/json/parquet/arrow or .txt files) or a token store (python -m "
        "titanlite.data.prepare, read in one order at any scale); setting it means dataset = local",
    )
    dataset_mix: list[DataSource] = opt(
        [],
        'weighted sources instead of dataset/dataset_path, a TOML array of tables [{ path = "a", weight = 0.7 }, ...] '
        "(stores or raw files); read in one order at any scale",
    )
    dataset_text_field: str = opt("text", "field holding the text in json/parquet/arrow records")
    dataset_format: str = opt(
        "text",
        "text (documents in dataset_text_field), chat (records with messages, a list of {role, content}: "
        "system/user/assistant), prompt_completion (records with prompt and completion) or preference (records with "
        "prompt, chosen and rejected, trained with DPO: the [dpo] section); chat and prompt_completion are rendered "
        "with the chat template and packed whole (training.packing), in one order at any scale, and dataset_path may "
        "also be a chat store (python -m titanlite.data.prepare --format chat); preference pairs are rendered with the "
        "chat template, one sequence per row; prompts (records with a prompt, text or a list of messages, and any "
        "fields the reward functions read) are trained with reinforcement learning: the [rl] section",
        choices=("text", "chat", "prompt_completion", "preference", "prompts"),
    )
    train_on: str = opt(
        "assistant",
        "with dataset_format chat or prompt_completion, the tokens in the loss: every assistant turn, the "
        "last_assistant turn only, or all of the conversation",
        choices=("assistant", "last_assistant", "all"),
    )
    chat_template: str = opt(
        "",
        "jinja chat template file for dataset_format chat, prompt_completion or preference; empty = the chat_template "
        "of the tokenizer_config.json in model.hf_assets_path",
    )
    packing: bool = opt(
        True,
        "with dataset_format chat or prompt_completion, pack several whole conversations into each window (best fit; "
        "each attends only to itself, its positions from 0); false = one conversation per window, padded",
    )
    num_workers: int = opt(0, "data-loading worker processes per rank", at_least=0)
    mixed_precision_param: str = opt(
        "bfloat16", "dtype FSDP computes in (autocast dtype without FSDP)", choices=("bfloat16", "float32")
    )
    mixed_precision_reduce: str = opt("float32", "dtype of FSDP gradient reduction", choices=("float32", "bfloat16"))
    param_dtype: str = opt(
        "float32",
        "dtype the weights are stored and updated in; bfloat16 = pure-bf16 training (with mixed_precision_param "
        "bfloat16 and optimizer.name AdamWBF16Kahan)",
        choices=("float32", "bfloat16"),
    )
    gc_freq: int = opt(
        50, "run Python's garbage collector every this many steps (automatic gc is turned off)", at_least=1
    )
    deterministic: bool = opt(False, "use deterministic algorithms (slower; for debugging numerics)")
    loss_chunk_tokens: int = opt(
        0,
        "tokens per chunk of the fused output projection + cross-entropy, which never holds the whole micro-batch's "
        "logits (0 = off: the logits of the whole micro-batch, then the loss); opt-in while its GPU speed is "
        "unmeasured",
        at_least=0,
    )
    skip_nan_check: bool = opt(
        False,
        "keep training when the loss or gradient norm is NaN or inf (by default the run stops at that step and saves "
        "nothing of it)",
    )
    on_nonfinite: str = opt(
        "stop",
        "a step whose loss or gradients hold NaN or inf: stop (the run stops at that step and saves nothing of it) or "
        "skip (its update is not applied: gradients dropped, optimizer and lr schedule not stepped, its batch "
        "consumed; costs one host-device sync per step)",
        choices=("stop", "skip"),
    )
    max_nonfinite_skips: int = opt(
        5, "with on_nonfinite skip, stop the run after this many skipped steps in a row", at_least=1
    )


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


@dataclass
class LoRA:
    rank: int = opt(
        0,
        "rank of the low-rank adapters added to the target layers, whose own weights are then frozen; 0 = no LoRA "
        "(every weight trains)",
        at_least=0,
    )
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / rank", above=0)
    dropout: float = opt(0.0, "dropout on the adapters' input while training", at_least=0, below=1)
    target_modules: list[str] = opt(
        ["wq", "wk", "wv", "wo"],
        "the linear layers that get adapters, by their name in the model (attention: wq,wk,wv,wo; MLP: w1,w2,w3; the "
        "output layer: output)",
    )
    base_dtype: str = opt(
        "float32",
        "dtype the frozen linear weights are kept in; bfloat16 halves their memory and changes no result, since with "
        "training.mixed_precision_param bfloat16 (required) they compute in bfloat16 anyway (embeddings and norms stay "
        "float32)",
        choices=("float32", "bfloat16"),
    )


@dataclass
class DPO:
    """Direct preference optimization, for training.dataset_format preference (titanlite/objectives/dpo.py)."""

    beta: float = opt(
        0.1,
        "a completion's reward is beta x (its log-probability under the policy - under the reference), "
        "log-probabilities summed over its trained tokens; a higher beta keeps the policy nearer the reference",
        above=0,
    )
    loss_type: str = opt(
        "sigmoid",
        "sigmoid (the DPO paper: -log sigmoid of the chosen reward minus the rejected one) or ipo (IPO: the squared "
        "distance of the log-ratio margin, with log-probabilities averaged over the completion's tokens as TRL does, "
        "from 1 / (2 beta))",
        choices=("sigmoid", "ipo"),
    )
    label_smoothing: float = opt(
        0.0,
        "loss_type sigmoid: the assumed share of pairs whose chosen and rejected are swapped (conservative DPO); 0 = "
        "none",
        at_least=0,
        below=0.5,
    )
    reference: str = opt(
        "initial",
        "the frozen reference model: initial (the weights training starts from, checkpoint.initial_load_path or "
        "job.seed's; under LoRA the base with the adapters switched off, no second copy) or the path of a Hugging Face "
        "folder or a DCP step folder of the same model (a frozen copy, sharded like the policy)",
    )


# The [rl] choices, spelled once: the rl/ modules that compute them import these.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
REWARD_SCALINGS = ("group", "batch", "none")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_SAMPLING_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class RL:
    """Reinforcement learning with verifiable rewards, for training.dataset_format prompts
    (titanlite/objectives/grpo.py)."""

    num_generations: int = opt(
        8,
        "completions sampled per prompt (the group); training.global_batch_size counts completions and must be a "
        "multiple of it",
        at_least=2,
    )
    max_new_tokens: int = opt(
        256, "tokens generated at most per completion (the prompt and they must fit in training.seq_len)", at_least=1
    )
    temperature: float = opt(
        1.0,
        "sampling temperature of the rollouts; the log-probabilities trained on are those of the logits divided by it, "
        "as sampled",
        above=0,
    )
    top_p: float = opt(
        1.0,
        "sample from the smallest set of most likely tokens whose probabilities reach top_p; 1 = all",
        above=0,
        at_most=1,
    )
    top_k: int = opt(0, "sample from the k most likely tokens only; 0 = all", at_least=0)
    epsilon: float = opt(
        0.2,
        "the probability ratio of a token (policy / the policy that sampled it) is clipped below at 1 - epsilon",
        above=0,
        below=1,
    )
    epsilon_high: float = opt(
        -1.0, "and above at 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); -1 = epsilon", above=0, sentinels=(-1.0,)
    )
    beta: float = opt(
        0.0,
        "weight of the KL penalty against the reference (the k3 estimator); 0 = none and no reference model",
        at_least=0,
    )
    reference: str = opt(
        "initial",
        "with beta above 0, the frozen reference: initial (the weights training starts from; under LoRA the base with "
        "the adapters switched off, no second copy) or the path of a Hugging Face folder or a DCP step folder of the "
        "same model",
    )
    num_iterations: int = opt(
        1,
        "optimizer steps on each batch of rollouts (their old log-probabilities computed once, before the first)",
        at_least=1,
    )
    loss_type: str = opt(
        "dapo",
        "how token losses make the step's loss, with TRL 1.16's meanings: grpo (each completion's mean, averaged), "
        "bnpo and dapo (the sum over the global batch's completion tokens divided by their number: the same here, "
        "where the batch is always the global one), dr_grpo (the sum divided by completions x max_new_tokens), cispo "
        "(the ratio capped at epsilon_high and detached, times the advantage and the log-probability), sapo (a sigmoid "
        "gate of the ratio in place of the clip), luspo (each completion's token sum, averaged: meant for "
        "importance_sampling_level sequence), vespo (a gamma weight of the sequence's ratio times the log-probability)",
        choices=GRPO_LOSS_TYPES,
    )
    importance_sampling_level: str = opt(
        "token",
        "the ratio the loss clips: per token, or sequence (GSPO: the exponent of the mean log-ratio over the "
        "completion)",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    sapo_temperature_neg: float = opt(1.05, "sapo: the gate's temperature where the advantage is not positive", above=0)
    sapo_temperature_pos: float = opt(1.0, "sapo: the gate's temperature where the advantage is positive", above=0)
    vespo_k_pos: float = opt(2.0, "vespo: the power k of the sequence ratio w where the advantage is >= 0", at_least=0)
    vespo_lambda_pos: float = opt(3.0, "vespo: the decay lambda where the advantage is >= 0", at_least=0)
    vespo_k_neg: float = opt(3.0, "vespo: the power k where the advantage is negative", at_least=0)
    vespo_lambda_neg: float = opt(2.0, "vespo: the decay lambda where the advantage is negative", at_least=0)
    entropy_coef: float = opt(
        0.0,
        "entropy bonus: the loss minus this times the mean entropy of the trained tokens (those top_entropy_quantile "
        "keeps); 0 = none",
        at_least=-1000,
        at_most=1000,
    )
    top_entropy_quantile: float = opt(
        1.0,
        "train only this top share of the global batch's completion tokens by entropy (one threshold per step, over "
        "every rank); 1 = all",
        at_least=0,
        at_most=1,
    )
    scale_rewards: str = opt(
        "group",
        "advantages are rewards minus their group's mean, divided by the std of the group, of the whole batch, or by "
        "nothing (none: Dr. GRPO)",
        choices=REWARD_SCALINGS,
    )
    multi_objective_aggregation: str = opt(
        "sum_then_normalize",
        "with several reward functions: sum their weighted rewards, then scale as scale_rewards says; or "
        "normalize_then_sum (GDPO): normalise each function's rewards in its group, sum them weighted, then normalise "
        "over the batch",
        choices=REWARD_AGGREGATIONS,
    )
    reward_functions: list[str] = opt(
        [],
        "reward functions, each path/to/file.py:function or module:function, called as TRL calls them "
        "(docs/rewards.md), e.g. titanlite.rewards:math_answer",
    )
    reward_weights: list[float] = opt(
        [],
        "each reward function's weight in the reward (negative: a penalty); empty = 1 each",
        at_least=-1000,
        at_most=1000,
    )
    mask_truncated_completions: bool = opt(False, "completions cut at max_new_tokens (no eos) are left out of the loss")
    max_staleness: int = opt(
        0,
        "asynchronous rollouts: step s trains on completions sampled by the weights after step max(0, s - 1 - "
        "max_staleness), generated while the steps before it train, on a fixed schedule (a run and its resume are the "
        "same run); 0 = each step samples its own with the current weights",
        at_least=0,
        at_most=16,
    )
    importance_sampling: str = opt(
        "none",
        "off-policy correction of the surrogate by the trainer/sampler probability ratio, with TRL's meanings "
        "(vllm_importance_sampling_mode): per token or per completion (sequence), clamped into the clip range "
        "(truncate) or zeroed outside it (mask); none = no correction (the colocated sampler is the trainer's own "
        "policy)",
        choices=IMPORTANCE_SAMPLING_MODES,
    )
    importance_sampling_clip_max: float = opt(3.0, "rl.importance_sampling's upper bound on the ratio", above=0)
    importance_sampling_clip_min: float = opt(
        -1.0, "rl.importance_sampling's lower bound on the ratio; -1 = none", at_least=0, sentinels=(-1.0,)
    )
    off_policy_mask_threshold: float = opt(
        -1.0,
        "drop a completion with a negative advantage whose mean sampler - trainer log-probability ratio passes this "
        "(DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold); -1 = off",
        at_least=0,
        sentinels=(-1.0,),
    )
    log_rollouts: bool = opt(
        False,
        "write every trained completion (step, policy_step, prompt and completion as text and ids, the sampler's "
        "logprobs, rewards, reward, advantage) to <dump_folder>/rollouts.jsonl, each step once",
    )
    log_completions: bool = opt(
        False,
        "print a few (prompt, completion, reward) of each rollout batch that serves a logged step to the console, as "
        "TRL does",
    )
    tools: list[str] = opt(
        [],
        "tools the model may call (docs/agents.md), each path/to/file.py:function or module:function: typed functions "
        "with Google-style docstrings, given to the chat template as TRL gives them",
    )
    environment: str = opt(
        "",
        "path/to/file.py:Factory (or module:Factory) making one environment per rollout, as TRL's environment_factory: "
        "reset(**record) may add text to the prompt, its public methods are tools, an optional get_reward() is one "
        "more reward (docs/agents.md)",
    )
    max_tool_calling_iterations: int = opt(
        -1,
        "rounds of tool calls answered at most per completion; -1 = as many as rl.max_new_tokens allows (TRL's None)",
        at_least=0,
        sentinels=(-1,),
    )
    tool_timeout_seconds: float = opt(
        10.0,
        "a tool call that has not returned after this long is answered with an error (its thread abandoned)",
        above=0,
    )


@dataclass
class FaultTolerance:
    """Replica groups that survive one another's loss (torchft); the lighthouse address is TORCHFT_LIGHTHOUSE."""

    enable: bool = opt(
        False,
        "this job is one replica group of a fault-tolerant run: gradients are averaged with the other groups through "
        "torchft's lighthouse (TORCHFT_LIGHTHOUSE=http://host:port, from torchft_lighthouse), a lost group is left "
        "behind and a restarted one recovers from a live peer (docs/launching.md)",
    )
    replica_id: int = opt(
        0, "this replica group's index, 0 to group_size - 1; a restarted group keeps its id", at_least=0
    )
    group_size: int = opt(
        1, "the number of replica groups; each reads its own share of every step's global batch", at_least=1
    )
    min_replica_size: int = opt(
        1,
        "a step commits only when at least this many groups took part in it; fewer and the step is not applied",
        at_least=1,
    )
    process_group: str = opt(
        "auto",
        "the collective library between groups: auto (nccl on CUDA, gloo on the CPU), gloo or nccl",
        choices=("auto", "gloo", "nccl"),
    )
    process_group_timeout_ms: int = opt(
        10000,
        "a collective between groups, a quorum or a state transfer that takes longer than this is a failure: the step "
        "is not applied and the next quorum leaves the slow group out",
        at_least=1,
    )
    quorum_timeout_seconds: int = opt(
        60,
        "the longest a group waits for a quorum (the first: job.init_timeout_seconds); the request is sent again every "
        "5 s meanwhile, so a lighthouse restarted at the same address is reached; none in time, the group saves its "
        "last committed step and stops, naming the lighthouse",
        at_least=1,
    )
    semi_sync_method: str = opt(
        "none",
        "none: the groups average every step's gradients; diloco: each group trains sync_steps steps alone, then the "
        "groups average how far their weights moved (the pseudo-gradient) and apply it with an outer Nesterov SGD "
        "(DiLoCo, torchft.local_sgd), for groups joined by slow links",
        choices=("none", "diloco"),
    )
    sync_steps: int = opt(
        20,
        "diloco: the steps each group trains alone between two synchronizations; checkpoint.interval and "
        "training.steps must be multiples of it",
        at_least=1,
    )
    outer_lr: float = opt(
        0.7,
        "diloco: the outer SGD's learning rate on the averaged pseudo-gradient (1 with outer_momentum 0 is plain "
        "weight averaging)",
        above=0,
    )
    outer_momentum: float = opt(0.9, "diloco: the outer SGD's Nesterov momentum; 0 = none", at_least=0, below=1)


@dataclass
class Generate:
    prompt: str = opt("", "text to continue (python -m titanlite.generate); empty = the prompts of prompts_file")
    prompts_file: str = opt(
        "",
        'JSON-lines file of prompts, one per line: {"prompt": text}, {"messages": [...]} (the chat template applied '
        'with the generation prompt) or {"token_ids": [...]}',
    )
    checkpoint: str = opt(
        "",
        "a DCP step folder (<dump_folder>/checkpoint/step-N) to take the weights from; empty = as training finds them "
        "(the newest or checkpoint.load_step checkpoint of job.dump_folder when checkpoint.enable, else "
        "checkpoint.initial_load_path or the model.hf_assets_path folder)",
    )
    max_new_tokens: int = opt(128, "tokens generated at most per prompt", at_least=1)
    temperature: float = opt(0.0, "sampling temperature; 0 = greedy (the most likely token each time)", at_least=0)
    top_p: float = opt(
        1.0,
        "sample from the smallest set of most likely tokens whose probabilities reach top_p; 1 = all",
        above=0,
        at_most=1,
    )
    top_k: int = opt(0, "sample from the k most likely tokens only; 0 = all", at_least=0)
    seed: int = opt(
        0,
        "seed of the sampling; the same seed, prompts and weights give the same completions",
        at_least=0,
        at_most=2**32 - 1,
    )
    min_new_tokens: int = opt(
        0,
        "the stop tokens cannot end a completion before this many new tokens (transformers' min_new_tokens)",
        at_least=0,
    )
    ignore_eos: bool = opt(
        False,
        "the stop tokens end nothing: every completion runs to max_new_tokens (or a stop string), as benchmarks need",
    )
    stop: list[str] = opt(
        [],
        "strings that end a completion (cut off before them); generation also ends at the tokenizer's eos and "
        "end-of-turn tokens",
    )
    batch_size: int = opt(8, "prompts generated together (left-padded to the longest of them)", at_least=1)
    compile: bool = opt(
        False,
        "torch.compile the decode step (CPU inductor with frozen weights, or CUDA): faster from the second batch of a "
        "shape on, after a compile of tens of seconds",
    )
    output: str = opt(
        "",
        'JSON-lines file written with one {"prompt", "completion", "token_ids"} per prompt (token_ids: the new tokens '
        "only); empty = stdout",
    )


@dataclass
class Eval:
    tasks: list[str] = opt(
        [],
        "lm-eval task or group names to evaluate the model on while it trains (e.g. hellaswag,arc_easy); scalars "
        "eval/<task>/<metric> go to TensorBoard and the console",
    )
    include_path: str = opt(
        "", "folder of extra lm-eval task YAML files (local tasks); empty = lm-eval's own tasks only"
    )
    limit: int = opt(-1, "at most this many examples per task; -1 = all", at_least=1, sentinels=(-1,))
    num_fewshot: int = opt(
        -1, "few-shot examples in each prompt; -1 = each task's own default", at_least=0, sentinels=(-1,)
    )
    batch_size: int = opt(8, "sequences per forward while evaluating", at_least=1)
    interval: int = opt(0, "evaluate every this many steps; 0 = never during the run", at_least=0)
    at_end: bool = opt(False, "also evaluate after the last step")
    sample_prompts: str = opt(
        "",
        "JSON-lines prompts file (as generate.prompts_file) whose greedy completions go to TensorBoard's text tab at "
        "each evaluation",
    )
    max_new_tokens: int = opt(64, "tokens generated at most for each of sample_prompts", at_least=1)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    plan: Plan = field(default_factory=Plan)
    lora: LoRA = field(default_factory=LoRA)
    dpo: DPO = field(default_factory=DPO)
    rl: RL = field(default_factory=RL)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    generate: Generate = field(default_factory=Generate)
    eval: Eval = field(default_factory=Eval)
