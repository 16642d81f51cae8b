"""The planner counts GRPO's rollout (titanlite/plan/rollout.py): on 8 GPUs under FSDP the whole policy gathered in
bf16, the KV cache of the rank's completions and a decode step's logits, by hand for Llama 3 8B; its time is part
of the step's; without FSDP nothing is gathered; under TP each rank keeps its half of the copy and of the cache.
Under rl.generator_ranks the trainers are the rest of the GPUs, hold the whole copy only, and wait for their
generator's decode at K = 0, for less of it at K = 1."""

import json

import pytest

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.models import get_model_spec
from titanlite.models.construct import meta_model
from titanlite.plan.hardware import BANDWIDTH, GPUS
from titanlite.plan.job import model_args, plan_job
from titanlite.plan.memory import GIB


def grpo_job(tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    return load_config(
        [
            "--job.config_file",
            "train_configs/llama3_8b.toml",
            "--training.dataset_format",
            "prompts",
            "--training.dataset_path",
            str(prompts),
            "--rl.reward_functions",
            "titanlite.rewards:math_answer",
            "--training.seq_len",
            "1024",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "64",
            "--rl.num_generations",
            "8",
            "--rl.max_new_tokens",
            "512",
            "--checkpoint.initial_load_path",
            "",
            *extra,
        ]
    )


def test_the_rollout_is_counted_by_hand_for_llama3_8b(tmp_path):
    cfg = grpo_job(tmp_path)
    plan = plan_job(cfg)
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    params = meta_model(spec, args, "float32", cfg.lora).num_params()
    rows = 64 // 8  # the rank's completions
    columns = 1088  # seq_len + 1 rounded up to 64
    kv_cache = args.n_layers * rows * columns * args.n_kv_heads * 2 * args.head_dim * 2  # keys and values, bf16
    logits = 4 * rows * args.vocab_size * 4
    memory = plan.memory
    assert memory.rollout == params * 2 + kv_cache + logits
    assert memory.peak >= memory.params + memory.optimizer + memory.rollout
    assert 0 < plan.speed.rollout_s < plan.speed.step_s
    assert memory.rollout / GIB == pytest.approx(15.0 + 1.06 + 0.03, abs=0.1)  # 8.03B parameters in bf16


def test_one_gpu_decodes_the_policy_itself(tmp_path):
    cfg = grpo_job(tmp_path, "--plan.gpus_per_node", "1", "--training.global_batch_size", "8")
    args = model_args(cfg, get_model_spec(cfg.model.name))
    kv_cache = args.n_layers * 8 * 1088 * args.n_kv_heads * 2 * args.head_dim * 2
    assert plan_job(cfg).memory.rollout == kv_cache + 4 * 8 * args.vocab_size * 4  # no gathered copy


def test_tensor_parallel_2_keeps_half_the_copy_and_of_the_cache(tmp_path):
    cfg = grpo_job(tmp_path, "--parallelism.tensor_parallel_degree", "2")
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, spec)
    params = meta_model(spec, args, "float32", cfg.lora).num_params()
    rows = 64 // 4  # 4 data-parallel ranks: a TP group decodes its rows together
    kv_cache = args.n_layers * rows * 1088 * args.n_kv_heads * 2 * args.head_dim * 2 // 2
    assert plan_job(cfg).memory.rollout == params * 2 // 2 + kv_cache + 4 * rows * args.vocab_size * 4


def test_generator_ranks_leave_the_trainers_a_whole_copy_and_no_decode_state(tmp_path):
    cfg = grpo_job(tmp_path, "--rl.generator_ranks", "4")
    colocated = plan_job(grpo_job(tmp_path)).memory.rollout
    spec = get_model_spec(cfg.model.name)
    params = meta_model(spec, model_args(cfg, spec), "float32", cfg.lora).num_params()
    plan = plan_job(cfg)
    assert plan.world_size == 4  # 8 GPUs less 4 generator ranks
    assert plan.memory.rollout == params * 2 < colocated  # the bf16 copy only: no KV cache, no logits
    assert [role for role, _ in plan.roles] == ["every trainer"]
    with pytest.raises(UserError, match="rl.generator_ranks 8 leaves none of the 8 processes to train"):
        plan_job(grpo_job(tmp_path, "--rl.generator_ranks", "8"))


def test_a_synchronous_trainer_waits_for_its_generators_decode_and_an_asynchronous_one_less(tmp_path):
    flags = ("--rl.generator_ranks", "2", "--training.global_batch_size", "96")
    synchronous = plan_job(grpo_job(tmp_path, *flags)).speed
    ahead = plan_job(grpo_job(tmp_path, *flags, "--rl.max_staleness", "1")).speed
    shape = grpo_job(tmp_path, *flags)
    spec = get_model_spec(shape.model.name)
    args = model_args(shape, spec)
    weights = meta_model(spec, args, "float32", shape.lora).num_params() * 2
    kv_cache = args.n_layers * 16 * 1088 * args.n_kv_heads * 2 * args.head_dim * 2  # a trainer's 96 // 6 rows
    gpu = GPUS[shape.plan.gpu]
    decode = 3 * 512 * (weights + kv_cache / 2) / (gpu.hbm_tbps * 1e12 * BANDWIDTH)  # 3 trainers per generator
    assert synchronous.rollout_s > decode
    training = synchronous.step_s - synchronous.rollout_s
    assert synchronous.rollout_s - ahead.rollout_s == pytest.approx(min(decode, training), rel=1e-6)
