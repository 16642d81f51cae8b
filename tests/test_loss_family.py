"""The GRPO loss family (titanlite/rl/loss_family.py) against TRL 1.16's own code, run here:

- loss and gradient: TRL's GRPOTrainer._compute_loss, get_high_entropy_mask and get_gamma_weights run unchanged on a
  GRPOTrainer made with object.__new__ (no model, no download): the attributes its __init__ sets from a real
  GRPOConfig are set by `bare_trainer` from that config, line for line, its accelerator is a real one-process
  accelerate.Accelerator, and the one seam replaced is _get_per_token_logps_and_entropies, which returns the
  log-probs and entropies of fixed fp64 logits (log_softmax at a temperature, differentiable, ours). Our functions
  get the same logits' log-probs and entropies; both gradients are taken with respect to those logits. Every
  loss_type x importance level TRL accepts, on-policy (ratio 1, old = logps.detach()) and off (old log-probs given,
  as with num_iterations 2), with the KL, the top-entropy mask with the entropy bonus, and the sampler's correction,
  within 1e-9 (fp64); and ours over 2 "ranks" x 2 micro-batches with the global batch's normalizers and entropy
  threshold, summed, equals TRL's on one process holding the whole batch.
- advantages: TRL's _generate_and_score_completions on a real GRPOTrainer (a tiny random Llama) with two reward
  functions, against aggregated_advantages, for both multi_objective_aggregation values.
- kept_entropies gathers over 2 gloo processes what one process holds."""

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest
import torch

from titanlite.rl.loss_family import (
    LOSS_TYPES,
    LossSettings,
    Normalizers,
    aggregated_advantages,
    check_loss_settings,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
    kept_entropies,
    per_token_loss,
    reduce_loss,
)

trl = pytest.importorskip("trl")
accelerate = pytest.importorskip("accelerate")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

TEMPERATURE = 0.7
B, T, V = 8, 6, 11
LENGTHS = [6, 1, 4, 6, 2, 5, 3, 6]
MAX_COMPLETION_LENGTH = 7
VARIANTS = {  # GRPOConfig keys on top of its defaults
    "plain": dict(beta=0.0),
    "kl": dict(beta=0.04, epsilon_high=0.28),
    "entropy": dict(beta=0.04, top_entropy_quantile=0.4, entropy_coef=0.01),
    "sampler": dict(beta=0.04),  # and TRL's vLLM importance-sampling correction (its default) switched on
}


def grpo_config(**keys) -> "trl.GRPOConfig":
    """TRL's config with its defaults but for keys (and one process on the CPU, no reports)."""
    defaults = dict(
        output_dir="unused",
        num_generations=2,
        per_device_train_batch_size=B,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
    )
    return trl.GRPOConfig(use_cpu=True, report_to="none", bf16=False, **{**defaults, **keys})


def bare_trainer(args, logps_and_entropies, sampler: bool = False) -> GRPOTrainer:
    """A GRPOTrainer without a model: what its __init__ sets from args for _compute_loss (grpo_trainer.py lines
    782-983), a real Accelerator, one process, no accumulation; _get_per_token_logps_and_entropies returns
    logps_and_entropies() and no aux loss. sampler: use_vllm, which switches on args.vllm_importance_sampling_correction
    (True by default): the loss times inputs["importance_sampling_ratio"]."""
    trainer = object.__new__(GRPOTrainer)
    trainer.args, trainer.accelerator = args, accelerate.Accelerator(cpu=True)
    trainer.model = torch.nn.Module()  # in training mode: "train" metrics and accumulation
    trainer.max_completion_length, trainer.beta = args.max_completion_length, args.beta
    trainer.loss_type, trainer.importance_sampling_level = args.loss_type, args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.use_vllm = sampler
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.off_policy_mask_threshold, trainer.aux_loss_enabled = args.off_policy_mask_threshold, False
    trainer.top_entropy_quantile, trainer.entropy_coef = args.top_entropy_quantile, args.entropy_coef
    trainer.use_adaptive_entropy = args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.current_gradient_accumulation_steps = 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (*logps_and_entropies(), None)
    return trainer


def settings_of(args) -> LossSettings:
    """Our settings from the same GRPOConfig, by TRL's names."""
    names = {f.name for f in dataclasses.fields(LossSettings)} - {"epsilon_low", "epsilon_high"}
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    return LossSettings(
        epsilon_low=args.epsilon, epsilon_high=epsilon_high, **{name: getattr(args, name) for name in names}
    )


def logps_and_entropies(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / TEMPERATURE) at the targets and its entropy, both differentiable."""
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@dataclasses.dataclass
class Batch:
    logits: torch.Tensor  # [B, T, V] fp64 leaf
    targets: torch.Tensor
    mask: torch.Tensor  # [B, T] 0/1 long, right padding
    advantages: torch.Tensor
    old: torch.Tensor | None  # None: on-policy
    ref: torch.Tensor
    sampling_ratio: torch.Tensor


def make_batch(off_policy: bool) -> Batch:
    generator = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(B, T, V, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=generator)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    logps = logps_and_entropies(logits, targets)[0].detach()
    noise = lambda scale: scale * torch.randn(B, T, generator=generator, dtype=torch.float64)  # noqa: E731
    old = logps + noise(0.3) if off_policy else None
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 1.0, 0.0], dtype=torch.float64)
    sampling_ratio = torch.exp(noise(0.2))
    return Batch(logits, targets, mask, advantages, old, logps + noise(0.1), sampling_ratio)


def trl_loss_and_grad(args, batch: Batch, sampler: bool) -> tuple[torch.Tensor, torch.Tensor, GRPOTrainer]:
    trainer = bare_trainer(args, lambda: logps_and_entropies(batch.logits, batch.targets), sampler)
    inputs = dict(
        prompt_ids=torch.zeros(B, 2, dtype=torch.long),
        prompt_mask=torch.ones(B, 2, dtype=torch.long),
        completion_ids=batch.targets,
        completion_mask=batch.mask,
        advantages=batch.advantages,
        ref_per_token_logps=batch.ref,
        num_items_in_batch=batch.mask.sum(),
    )
    if sampler:  # vespo reads it whenever it is there
        inputs["importance_sampling_ratio"] = batch.sampling_ratio
    if batch.old is not None:
        inputs["old_per_token_logps"] = batch.old
    loss = trainer._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, batch.logits)
    return loss.detach(), grad, trainer


def our_loss_and_grad(
    s: LossSettings, batch: Batch, sampler: bool, pieces: list[slice]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our shares over pieces of the rows (each a micro-batch on some rank), each with its own forward, summed; the
    entropy threshold from every piece's entropies first (the no-gradient pass the caller makes)."""
    entropies = logps_and_entropies(batch.logits.detach(), batch.targets)[1]
    threshold, entropy_tokens = entropy_threshold(
        torch.cat([kept_entropies(entropies[rows], batch.mask[rows]) for rows in pieces]), s.top_entropy_quantile
    )
    norm = Normalizers(
        completions=B,
        tokens=int(batch.mask.sum()),
        max_completion_length=MAX_COMPLETION_LENGTH,
        entropy_tokens=entropy_tokens if s.top_entropy_quantile < 1 else None,
    )
    total, grad = 0.0, torch.zeros_like(batch.logits)
    for rows in pieces:
        logps, entropy = logps_and_entropies(batch.logits[rows], batch.targets[rows])
        mask = batch.mask[rows]
        old = logps.detach() if batch.old is None else batch.old[rows]
        keep = high_entropy_mask(entropy, mask, threshold) if s.top_entropy_quantile < 1 else None
        loss, _ = per_token_loss(
            logps,
            old,
            batch.advantages[rows],
            mask,
            s,
            ref_logps=batch.ref[rows],
            entropy_mask=keep,
            sampling_ratio=batch.sampling_ratio[rows] if sampler else None,
        )
        share = reduce_loss(loss, mask, s.loss_type, norm)
        if s.entropy_coef:
            share = share + entropy_bonus(entropy, mask, keep, s.entropy_coef, norm)
        grad += torch.autograd.grad(share, batch.logits)[0]
        total += share.detach()
    return total, grad


WHOLE = [slice(0, B)]
TWO_RANKS_TWO_MICRO_BATCHES = [slice(0, 3), slice(3, 4), slice(4, 6), slice(6, 8)]  # rank 0: rows 0-3, rank 1: 4-7


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("off_policy", [False, True], ids=["ratio_1", "old_logps"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trl_compute_loss(loss_type, level, off_policy, variant):
    cap = {"epsilon_high": 1.1} if loss_type == "cispo" else {}  # cispo's cap on r itself: one some ratios pass
    args = grpo_config(loss_type=loss_type, importance_sampling_level=level, **{**VARIANTS[variant], **cap})
    batch = make_batch(off_policy)
    theirs, their_grad, trainer = trl_loss_and_grad(args, batch, variant == "sampler")
    s = settings_of(args)
    for pieces in (WHOLE, TWO_RANKS_TWO_MICRO_BATCHES):
        ours, our_grad = our_loss_and_grad(s, batch, variant == "sampler", pieces)
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)
        torch.testing.assert_close(our_grad, their_grad, atol=1e-9, rtol=0)
    assert their_grad.abs().max() > 1e-3  # the comparison is not between two zeros
    if level == "token":  # TRL's metrics count tokens (at sequence level, sequences: ours repeat them per token)
        assert_stats_equal_trl_metrics(s, batch, trainer, variant == "sampler")


def assert_stats_equal_trl_metrics(s: LossSettings, batch: Batch, trainer: GRPOTrainer, sampler: bool):
    """TokenStats' masked means over the batch are the clip ratios and KL TRL's _compute_loss logged (it divides in
    fp32: 1e-6)."""
    logps = logps_and_entropies(batch.logits.detach(), batch.targets)[0]
    old = logps if batch.old is None else batch.old
    _, stats = per_token_loss(
        logps,
        old,
        batch.advantages,
        batch.mask,
        s,
        ref_logps=batch.ref,
        sampling_ratio=batch.sampling_ratio if sampler else None,
    )
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    mean = lambda x: ((x.double() * batch.mask).sum() / batch.mask.sum()).item()  # noqa: E731
    if s.beta:
        assert mean(stats.kl) == pytest.approx(metrics["kl"], abs=1e-6)
    if s.loss_type == "cispo":
        assert mean(stats.region_clipped) == pytest.approx(metrics["cispo_clip_ratio"], abs=1e-6)
        if batch.old is not None:
            assert 0 < mean(stats.region_clipped) < 0.5
    elif "clip_ratio/region_mean" in metrics:
        for name, clipped in [
            ("low", stats.low_clipped),
            ("high", stats.high_clipped),
            ("region", stats.region_clipped),
        ]:
            assert mean(clipped) == pytest.approx(metrics[f"clip_ratio/{name}_mean"], abs=1e-6)
        if batch.old is not None and s.loss_type in ("grpo", "dapo"):  # both sides clip here
            assert stats.low_clipped.any() and stats.high_clipped.any()


def test_the_entropy_mask_keeps_the_top_quantile_of_the_global_batch():
    """TRL's get_high_entropy_mask (one process) against ours over the rows of 2 ranks; 0 keeps the highest only."""
    generator = torch.Generator().manual_seed(1)
    entropies = torch.rand(B, T, generator=generator)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    trainer = bare_trainer(grpo_config(), lambda: None)
    for quantile in (0.0, 0.2, 0.5, 1.0):
        theirs = trainer.get_high_entropy_mask(entropies, mask, 1 - quantile)
        kept = torch.cat([kept_entropies(entropies[:4], mask[:4]), kept_entropies(entropies[4:], mask[4:])])
        threshold, count = entropy_threshold(kept, quantile)
        assert torch.equal(high_entropy_mask(entropies, mask, threshold), theirs)
        assert count == int(theirs.sum())
    assert int(theirs.sum()) == int(mask.sum()) and count == int(mask.sum())
    assert entropy_threshold(entropies[mask.bool()], 0.0)[1] == 1
    assert entropy_threshold(torch.zeros(0), 0.2)[1] == 0


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_entropy_threshold_is_torch_quantile(n):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for quantile in (0.0, 0.13, 0.2, 0.5, 0.8, 1.0):
        expected = torch.quantile(values.float(), 1 - quantile)
        assert torch.equal(entropy_threshold(values, quantile)[0], expected)


def test_settings_defaults_are_trls():
    assert LossSettings() == settings_of(grpo_config())


def test_trls_warnings_and_our_refusals():
    """TRL warns (grpo_trainer.py lines 916-934) and computes; what it cannot compute is refused naming the key."""
    assert check_loss_settings(LossSettings()) == []
    assert check_loss_settings(LossSettings(loss_type="luspo", importance_sampling_level="sequence")) == []
    assert "rl.importance_sampling_level to sequence" in " ".join(check_loss_settings(LossSettings(loss_type="luspo")))
    assert (
        "set rl.importance_sampling_level to token"
        in check_loss_settings(LossSettings(loss_type="vespo", importance_sampling_level="sequence"))[0]
    )
    for loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        (warning,) = check_loss_settings(LossSettings(loss_type=loss_type, importance_sampling_level="sequence"))
        assert "set rl.loss_type grpo" in warning
    refused = {
        "rl.loss_type is 'ppo'": LossSettings(loss_type="ppo"),
        "rl.importance_sampling_level is 'batch'": LossSettings(importance_sampling_level="batch"),
        "rl.top_entropy_quantile is 1.5": LossSettings(top_entropy_quantile=1.5),
        "rl.sapo_temperature_neg is 0": LossSettings(loss_type="sapo", sapo_temperature_neg=0),
    }
    for message, s in refused.items():
        with pytest.raises(ValueError, match=message):
            check_loss_settings(s)
    with pytest.raises(ValueError, match="rl.multi_objective_aggregation is 'mean'"):
        aggregated_advantages(torch.zeros(4, 2), torch.ones(2), 2, "group", "mean")
    with pytest.raises(ValueError, match="rl.entropy_coef is 0.01 but the entropies carry no gradient"):
        entropy_bonus(torch.ones(1, 3), torch.ones(1, 3), None, 0.01, Normalizers(1, 3, 3))
    with pytest.raises(ValueError, match="per token"):
        per_token_loss(
            torch.zeros(1, 3),
            torch.zeros(1, 3),
            torch.ones(1),
            torch.ones(1, 3),
            LossSettings(loss_type="vespo"),
            sampling_ratio=torch.ones(1, 1),
        )


# TRL's own advantages: a real GRPOTrainer on a tiny random Llama, two reward functions.

G = 4
PROMPTS = ["one two", "three four five six", "seven"]
CORRECT = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, None, 0.0, 1.0]
LENGTH = [0.3, 0.9, None, 0.1, 0.5, 0.5, 0.2, 0.7, 0.4, None, 0.6, 0.8]


@pytest.fixture(scope="module")
def scoring_trainer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from datasets import Dataset

    from titanlite.examples.chat_example import write_tokenizer_folder

    root = tmp_path_factory.mktemp("loss_family_trl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer_folder(root / "tokenizer")))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    )
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")

    def correct(prompts, completions, slot, **_):
        return [CORRECT[i] for i in slot]

    def length(prompts, completions, slot, **_):
        return [LENGTH[i] for i in slot]

    config = grpo_config(
        output_dir=str(root / "out"),
        per_device_train_batch_size=len(CORRECT),
        num_generations=G,
        max_completion_length=4,
        reward_weights=[1.0, -0.5],
        save_strategy="no",
        seed=0,
    )
    made = trl.GRPOTrainer(
        model=str(root / "policy"),
        reward_funcs=[correct, length],
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p, "slot": 0} for p in PROMPTS]),
    )
    made.model.train()
    return made


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_advantages_equal_trl(scoring_trainer, aggregation, scale_rewards):
    scoring_trainer.multi_objective_aggregation, scoring_trainer.scale_rewards = aggregation, scale_rewards
    batch = scoring_trainer._generate_and_score_completions(
        [{"prompt": PROMPTS[i // G], "slot": i} for i in range(len(CORRECT))]
    )
    rewards = torch.tensor([[math.nan if r is None else r for r in pair] for pair in zip(CORRECT, LENGTH)])
    advantages, zero_std = aggregated_advantages(rewards, torch.tensor([1.0, -0.5]), G, scale_rewards, aggregation)
    torch.testing.assert_close(advantages, batch["advantages"], atol=1e-6, rtol=0)
    expected = scoring_trainer._metrics["train"]["frac_reward_zero_std"][-1]
    assert zero_std.float().mean().item() == pytest.approx(expected)
    assert advantages[9] == 0  # every function returned None


GATHER = """
import sys, torch, torch.distributed as dist
from titanlite.rl.loss_family import kept_entropies
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
entropies = torch.arange(12, dtype=torch.float32).view(2, 6) + 100 * rank
mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]) if rank == 0 else torch.ones(2, 6, dtype=torch.long)
print(kept_entropies(entropies, mask).tolist())
dist.destroy_process_group()
"""


def test_kept_entropies_gathers_every_ranks_tokens_in_rank_order(tmp_path):
    """2 gloo processes holding 3 and 12 trained tokens each get all 15: the values one process holding both would
    give entropy_threshold."""
    script = tmp_path / "gather.py"
    script.write_text(textwrap.dedent(GATHER))
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "store")], stdout=subprocess.PIPE, text=True
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    expected = [0.0, 1.0, 6.0] + [100.0 + i for i in range(12)]
    assert [json.loads(out.strip().splitlines()[-1]) for out in outputs] == [expected, expected]
