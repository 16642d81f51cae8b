"""GRPO's math (titanlite/rl/grpo_loss.py) against TRL 1.16 and against its formulas:
- the advantages equal those TRL's GRPOTrainer._generate_and_score_completions computes from the same rewards;
- each loss_type's loss and gradient, computed in 2 "ranks" x 2 micro-batches and summed, equal the formula over the
  whole batch (TRL's _compute_loss written out with transformers' logits) within 1e-6 of the gradient's scale, and equal
  what
  TRL's own _compute_loss returns on one process;
- log-probs and entropy are those of log_softmax(logits / temperature), their gradient that of autograd's."""

import pytest
import torch

from titanlite.data.batch import Normalizers
from titanlite.rl import grpo_loss
from titanlite.rl.grpo_loss import group_advantages, token_logps
from titanlite.rl.loss_family import LossSettings, per_token_loss, reduce_loss

transformers = pytest.importorskip("transformers")

G = 4
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the clipped surrogate's (the rest: test_loss_family.py)
TEMPERATURE = 0.7
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04
SETTINGS = LossSettings(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=BETA)  # the loss type only picks the reduction
# Completion i belongs to prompt i // G: a spread group, a group of equal rewards (zero std), a group with a
# completion no reward function scored (None: left out of its group's statistics, advantage 0).
REWARDS = [1.0, 2.0, 3.0, 3.0, 5.0, 5.0, 5.0, 5.0, 0.0, None, 1.0, 0.5]
PROMPTS = ["one two", "three four five six", "seven"]
LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
)


def as_tensor(rewards: list) -> torch.Tensor:
    return torch.tensor([float("nan") if r is None else r for r in rewards])


def trl_loss(logps, old, ref, advantages, mask, loss_type, max_completion_length):
    """TRL 1.16's _compute_loss on one process holding the whole batch (token-level importance sampling, its default
    bias-corrected KL, no accumulation), written out from its source."""
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    per_token = per_token + BETA * (torch.exp(ref - logps) - (ref - logps) - 1) * coef_1
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # dapo: num_items_in_batch, the batch's tokens


def completion_logits(model, ids, attention, prompt_length):
    """The logits that predict each completion token (position t predicts token t + 1)."""
    return model(input_ids=ids, attention_mask=attention).logits[:, prompt_length - 1 : -1]


def shared_loss(model, ids, attention, prompt_length, old, ref, advantages, mask, loss_type, max_completion_length):
    """Our loss as the step computes it: 2 ranks x 2 micro-batches, each its own forward and backward with its share
    of the global batch's loss; (the shares' sum, detached)."""
    norm = Normalizers(completions=len(ids), tokens=int(mask.sum()), max_completion_length=max_completion_length)
    total = 0.0
    for rank in range(2):
        for micro in range(2):
            rows = slice((2 * rank + micro) * len(ids) // 4, (2 * rank + micro + 1) * len(ids) // 4)
            logps, _ = token_logps(
                completion_logits(model, ids[rows], attention[rows], prompt_length),
                ids[rows, prompt_length:],
                TEMPERATURE,
            )
            loss, _ = per_token_loss(logps, old[rows], advantages[rows], mask[rows], SETTINGS, ref_logps=ref[rows])
            share = reduce_loss(loss, mask[rows], loss_type, norm)
            share.backward()
            total += share.detach()
    return total


def perturbed_logps(model, ids, attention, prompt_length, seed, scale=0.02):
    """The completion tokens' log-probs under a copy of model with noise on every weight: an old policy or a
    reference."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
        return token_logps(completion_logits(copy, ids, attention, prompt_length), ids[:, prompt_length:], TEMPERATURE)[
            0
        ]


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_gradients_close(ours: list[torch.Tensor], expected: list[torch.Tensor]):
    """Every entry within 1e-6 of the gradient's scale (its largest entry, 2 to 9 here): fp32 rounds differently in
    4 forwards of a quarter of the rows than in one of all of them."""
    scale = max(1.0, max(g.abs().max().item() for g in expected))
    for our_grad, expected_grad in zip(ours, expected, strict=True):
        torch.testing.assert_close(our_grad, expected_grad, atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_the_formula_over_the_whole_batch(loss_type):
    """8 completions of lengths 1..6 (right-padded) after prompts of one length; old and reference log-probs from
    perturbed copies, so that the ratio is clipped on both sides."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=97, **LLAMA)).float()
    prompt_length, max_completion_length = 5, 7
    ids = torch.randint(0, 97, (8, prompt_length + 6))
    lengths = torch.tensor([6, 1, 4, 6, 2, 5, 3, 6])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    attention = torch.cat([torch.ones(8, prompt_length), mask], 1).long()
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 1.0, -1.0])
    old = perturbed_logps(model, ids, attention, prompt_length, seed=1, scale=0.05)
    ref = perturbed_logps(model, ids, attention, prompt_length, seed=2)

    logps = torch.log_softmax(completion_logits(model, ids, attention, prompt_length) / TEMPERATURE, -1)
    logps = logps.gather(-1, ids[:, prompt_length:, None]).squeeze(-1)
    expected = trl_loss(logps, old, ref, advantages, mask, loss_type, max_completion_length)
    expected.backward()
    expected_grads = grads(model)

    ours = shared_loss(
        model, ids, attention, prompt_length, old, ref, advantages, mask, loss_type, max_completion_length
    )
    torch.testing.assert_close(ours, expected.detach(), atol=1e-6, rtol=0)
    assert_gradients_close(grads(model), expected_grads)

    _, stats = per_token_loss(logps.detach(), old, advantages, mask, SETTINGS, ref_logps=ref)
    real = mask.bool()
    assert (stats.low_clipped & real).any() and (stats.high_clipped & real).any()
    assert torch.equal(stats.region_clipped, stats.low_clipped | stats.high_clipped)


def test_normalizers_differ_by_loss_type():
    """One sequence of 3 tokens (loss 1 each) and one of 1 (loss 4) out of max_completion_length 4."""
    loss = torch.tensor([[1.0, 1.0, 1.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    norm = Normalizers(completions=2, tokens=4, max_completion_length=4)
    assert reduce_loss(loss, mask, "grpo", norm).item() == pytest.approx((1 + 4) / 2)
    assert reduce_loss(loss, mask, "bnpo", norm).item() == pytest.approx(7 / 4)
    assert reduce_loss(loss, mask, "dapo", norm).item() == pytest.approx(7 / 4)
    assert reduce_loss(loss, mask, "dr_grpo", norm).item() == pytest.approx(7 / 8)


def test_advantages_by_hand():
    """Group (1, 3): mean 2, unbiased std sqrt(2); group (5, 5): std 0, so advantage 0 and zero_std."""
    advantages, zero_std = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2, "group")
    torch.testing.assert_close(advantages, torch.tensor([-1, 1, 0, 0]) / (2**0.5 + 1e-4))
    assert zero_std.tolist() == [False, False, True, True]
    advantages, zero_std = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2, "none")
    assert advantages.tolist() == [-1.0, 1.0, 0.0, 0.0] and zero_std.tolist() == [False, False, True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logps_at_a_temperature(dtype, monkeypatch):
    """log_softmax(logits / 0.7) gathered and its entropy, in fp32 whatever the logits' dtype, several chunks of rows
    at a time (the chunk made small), and the gradient autograd gives for the same formula."""
    monkeypatch.setattr(grpo_loss, "CHUNK_ELEMENTS", 3 * 50)  # pieces of 3 positions, and of 1 at the end of a row
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 4, 50)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (2, 4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logps, entropy = token_logps(logits, targets, TEMPERATURE)
    assert logps.dtype == entropy.dtype == torch.float32 and entropy.requires_grad
    # kept for backward: the logits themselves (no fp32 copy), the targets, each position's logsumexp and entropy
    assert [t.shape for t in saved] == [logits.shape, targets.shape, targets.shape, targets.shape]
    assert saved[0].data_ptr() == logits.data_ptr()

    reference = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    expected = reference.gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1), atol=1e-5, rtol=1e-6)

    weights = torch.randn(2, 4)
    (ours,) = torch.autograd.grad((logps * weights).sum(), logits, retain_graph=True)
    (theirs,) = torch.autograd.grad((expected * weights).sum(), logits, retain_graph=True)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, theirs, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    # the entropy's gradient (rl.entropy_coef's bonus), alone and with the log-probs'
    expected_entropy = -(reference.exp() * reference).sum(-1)
    for ours_total, their_total in (
        ((entropy * weights).sum(), (expected_entropy * weights).sum()),
        ((entropy * weights + logps).sum(), (expected_entropy * weights + expected).sum()),
    ):
        (ours,) = torch.autograd.grad(ours_total, logits, retain_graph=True)
        (theirs,) = torch.autograd.grad(their_total, logits, retain_graph=True)
        torch.testing.assert_close(ours, theirs, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


def test_wrong_arguments_say_which():
    with pytest.raises(ValueError, match="scale_rewards is 'mean'"):
        group_advantages(torch.zeros(4), 2, "mean")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(torch.zeros(5), 2, "group")
    with pytest.raises(ValueError, match="loss_type is 'sum'"):
        reduce_loss(torch.zeros(1, 2), torch.ones(1, 2), "sum", Normalizers(1, 2, 2))
    with pytest.raises(ValueError, match="temperature is 0"):
        token_logps(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), LossSettings(beta=0.1))


# TRL's own code: a real GRPOTrainer on a tiny random Llama, called on one generation batch.


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """GRPOTrainer (TRL 1.16) on one process: 3 prompts x G completions of up to 6 tokens at TEMPERATURE, whose one
    reward function returns REWARDS by each completion's slot in the batch."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from titanlite.examples.chat_example import write_tokenizer_folder

    root = tmp_path_factory.mktemp("grpo_trl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_tokenizer_folder(root / "tokenizer")))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(tokenizer), **LLAMA)).float()
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")

    def fixed(prompts, completions, slot, **_):
        return [REWARDS[i] for i in slot]

    config = trl.GRPOConfig(
        output_dir=str(root / "out"),
        per_device_train_batch_size=len(REWARDS),
        num_generations=G,
        max_completion_length=6,
        temperature=TEMPERATURE,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        beta=BETA,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    made = trl.GRPOTrainer(
        model=str(root / "policy"),
        reward_funcs=fixed,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p, "slot": 0} for p in PROMPTS]),
    )
    made.model.train()  # the batch is scored as in training ("train" metrics, G completions per prompt)
    return made


def generation_batch(trainer) -> dict:
    """TRL's _generate_and_score_completions on the batch its sampler would give: each prompt G times in a row."""
    return trainer._generate_and_score_completions(
        [{"prompt": PROMPTS[i // G], "slot": i} for i in range(len(REWARDS))]
    )


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(trainer, scale_rewards):
    trainer.scale_rewards = scale_rewards  # the attribute _generate_and_score_completions reads
    batch = generation_batch(trainer)
    advantages, zero_std = group_advantages(as_tensor(REWARDS), G, scale_rewards)
    torch.testing.assert_close(advantages, batch["advantages"], atol=1e-6, rtol=0)
    assert zero_std.float().mean().item() == pytest.approx(trainer._metrics["train"]["frac_reward_zero_std"][-1])
    assert zero_std.any() == (scale_rewards != "batch")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trl_compute_loss(trainer, loss_type):
    """TRL's _compute_loss (its fused LM head at TEMPERATURE, its per-device normalisation on one process with no
    accumulation) on a generated batch whose completions are cut to lengths 1..6, against our shares summed over
    2 ranks x 2 micro-batches; its clip and entropy metrics against TokenStats and token_logps."""
    batch = generation_batch(trainer)
    completion_length = batch["completion_ids"].shape[1]
    lengths = torch.tensor([6, 1, 4, 6, 2, 5, 3, 6, 1, 6, 2, 4]).clamp(max=completion_length)
    mask = (torch.arange(completion_length)[None] < lengths[:, None]).long()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], mask], 1)
    prompt_length = batch["prompt_ids"].shape[1]
    model = trainer.model
    old = perturbed_logps(model, ids, attention, prompt_length, seed=1, scale=0.05)
    ref = perturbed_logps(model, ids, attention, prompt_length, seed=2)
    advantages = torch.linspace(-1.5, 1.5, len(ids))[
        torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    ]

    trainer.loss_type = loss_type
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this test does not run
    inputs = dict(
        batch,
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        num_items_in_batch=mask.sum(),
    )
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grads = grads(model)

    ours = shared_loss(
        model,
        ids,
        attention,
        prompt_length,
        old,
        ref,
        advantages,
        mask.float(),
        loss_type,
        trainer.max_completion_length,
    )
    torch.testing.assert_close(ours, theirs.detach(), atol=1e-6, rtol=0)
    assert_gradients_close(grads(model), their_grads)

    with torch.no_grad():
        logps, entropy = token_logps(
            completion_logits(model, ids, attention, prompt_length), ids[:, prompt_length:], TEMPERATURE
        )
    _, stats = per_token_loss(logps, old, advantages, mask, SETTINGS, ref_logps=ref)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    masked_mean = lambda x: ((x.float() * mask).sum() / mask.sum()).item()  # noqa: E731
    assert masked_mean(stats.region_clipped) == pytest.approx(metrics["clip_ratio/region_mean"], abs=1e-6)
    assert masked_mean(stats.low_clipped) == pytest.approx(metrics["clip_ratio/low_mean"], abs=1e-6)
    assert masked_mean(stats.kl) == pytest.approx(metrics["kl"], abs=1e-6)
    assert masked_mean(entropy) == pytest.approx(metrics["entropy"], abs=1e-5)
