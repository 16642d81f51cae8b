"""GRPO's off-policy correction (titanlite/rl/off_policy.py, rl.importance_sampling and rl.off_policy_mask_threshold)
against TRL 1.16 itself: a GRPOTrainer told that a vLLM sampler made the completions (its _generate replaced by one
returning fixed completions and the sampler's log-probabilities), whose _generate_and_score_completions computes the
importance-sampling ratio and whose _compute_loss weights the loss with it and the off-policy mask; our loss on the
same batch within 1e-6, for every mode and the mask."""

import pytest
import torch
from test_grpo_loss import BETA, EPS_HIGH, EPS_LOW, PROMPTS, REWARDS, TEMPERATURE, G, completion_logits, trainer  # noqa: F401

from titanlite.data.batch import Normalizers
from titanlite.rl.grpo_loss import token_logps
from titanlite.rl.loss_family import LossSettings, per_token_loss, reduce_loss
from titanlite.rl.off_policy import importance_ratio, off_policy_mask

LENGTHS = [6, 1, 4, 6, 2, 5, 3, 6, 1, 6, 2, 4]


def sampled_batch(trainer):
    """(prompt ids, completion ids, the sampler's log-probabilities) of the 12 completions: random tokens, and the
    trainer's own log-probabilities moved by noise of up to +-1.5 nats, so that ratios fall on both sides of a clip."""
    tokenizer = trainer.processing_class
    generator = torch.Generator().manual_seed(3)
    prompts = [tokenizer(PROMPTS[i // G])["input_ids"] for i in range(len(REWARDS))]
    completions = [torch.randint(5, len(tokenizer) - 5, (n,), generator=generator).tolist() for n in LENGTHS]
    sampler = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = completion_logits(trainer.model, ids, torch.ones_like(ids), len(prompt))
            own = token_logps(logits, torch.tensor([completion]), TEMPERATURE)[0][0]
        sampler.append((own + 3 * (torch.rand(len(completion), generator=generator) - 0.5)).tolist())
    return prompts, completions, sampler


def trl_batch(trainer, monkeypatch, mode: str, clip_min, clip_max, threshold):
    prompts, completions, sampler = sampled_batch(trainer)
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", clip_min)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_max", clip_max)
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", threshold)
    monkeypatch.setattr(trainer, "loss_type", "bnpo")
    monkeypatch.setattr(
        trainer, "_generate", lambda _: (prompts, completions, None, ["x"] * len(completions), sampler, {}, None, None)
    )
    trainer.current_gradient_accumulation_steps = 1
    inputs = [{"prompt": PROMPTS[i // G], "slot": i} for i in range(len(REWARDS))]
    return trainer._generate_and_score_completions(inputs), sampler


@pytest.mark.parametrize(
    "mode, clip_min, clip_max, threshold",
    [
        ("token_truncate", None, 3.0, None),
        ("token_mask", None, 3.0, None),
        ("sequence_truncate", None, 3.0, None),
        ("sequence_mask", None, 3.0, None),
        ("token_truncate", 0.5, 2.0, None),
        ("sequence_mask", 0.5, 1.5, None),
        ("token_mask", 0.3, 3.0, 0.1),
        ("sequence_truncate", None, 3.0, 0.0),
    ],
)
def test_each_correction_equals_trl_compute_loss(trainer, monkeypatch, mode, clip_min, clip_max, threshold):
    batch, sampler_list = trl_batch(trainer, monkeypatch, mode, clip_min, clip_max, threshold)
    model = trainer.model
    theirs = trainer._compute_loss(model, batch).detach()

    mask = batch["completion_mask"].float()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    prompt_length = batch["prompt_ids"].shape[1]
    with torch.no_grad():
        logps, _ = token_logps(
            completion_logits(model, ids, attention, prompt_length), batch["completion_ids"], TEMPERATURE
        )
    sampler = torch.zeros_like(logps)
    for row, values in enumerate(sampler_list):
        sampler[row, : len(values)] = torch.tensor(values)
    old, advantages = batch["old_per_token_logps"], batch["advantages"]
    ratio = importance_ratio(old, sampler, mask, mode, clip_min, clip_max)
    torch.testing.assert_close(ratio, batch["importance_sampling_ratio"], atol=1e-6, rtol=0)
    kept = None if threshold is None else off_policy_mask(advantages, logps, sampler, mask, threshold)
    settings = LossSettings(loss_type="bnpo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=BETA)
    loss, _ = per_token_loss(
        logps,
        old,
        advantages,
        mask,
        settings,
        ref_logps=batch["ref_per_token_logps"],
        sampling_ratio=ratio,
        off_policy_mask=kept,
    )
    ours = reduce_loss(loss, mask, "bnpo", Normalizers(len(ids), int(mask.sum()), trainer.max_completion_length))
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert ratio.min() < 1 < ratio.max()  # the sampler differs both ways: the correction is exercised
    if "mask" in mode:
        assert (ratio == 0).any()
