"""The sections of what a job is and trains on: [job], [model], [optimizer], [lr_scheduler], [training]."""

from dataclasses import dataclass

from titanlite.config_sections.options import opt


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
