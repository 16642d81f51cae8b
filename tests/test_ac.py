"""Activation checkpointing: same numbers as without it, same FQNs, and it really frees memory."""

import copy
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from titanlite.config_sections import ActivationCheckpoint
from titanlite.models.attention import document_ids
from titanlite.models.llama.args import LLAMA3_FLAVORS
from titanlite.models.llama.model import Transformer
from titanlite.parallel import ac
from titanlite.parallel.ac import apply_ac

TINY = replace(
    LLAMA3_FLAVORS["debugmodel"], dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64
)
MODES = {
    "full": ActivationCheckpoint(mode="full"),
    "selective-op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "selective-every-2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
}


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(seed=0)
    return model


def loss_and_grads(model, tokens):
    inputs = tokens[:, :-1]  # with documents: the mask goes through the checkpointed blocks too
    loss = F.cross_entropy(
        model(inputs, document_ids=document_ids(inputs, (0, 1))).flatten(0, 1), tokens[:, 1:].flatten()
    )
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    tokens = torch.randint(2, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    tokens[0, 7] = tokens[1, 20] = 0  # a bos: two documents per row
    model = tiny_model()
    return model, tokens, *loss_and_grads(model, tokens)


@pytest.mark.parametrize("mode", MODES)
def test_loss_grads_and_fqns_equal_no_ac(reference, mode):
    plain, tokens, loss, grads = reference
    model = copy.deepcopy(plain)
    model.zero_grad(set_to_none=True)
    apply_ac(model, MODES[mode])
    wrapped = [k for k, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == (["1", "3"] if mode == "selective-every-2" else ["0", "1", "2", "3"])
    assert list(model.state_dict()) == list(plain.state_dict())
    got_loss, got_grads = loss_and_grads(model, tokens)
    # named_parameters() (not the state dict) shows the wrapper; the names are otherwise the same.
    got_grads = {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in got_grads.items()}
    assert list(got_grads) == list(grads)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def forward_backward_stats(model, tokens) -> dict:
    """What the forward keeps for backward outside the checkpointed blocks, and what backward recomputes."""
    saved = {}

    def pack(tensor):
        saved[(tensor.untyped_storage().data_ptr(), tensor.dtype)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    with CountOps() as backward:
        loss.backward()
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return {
        "saved": sum(saved.values()),
        "mm": backward.counts[torch.ops.aten.mm.default],
        "attention": backward.counts[attention],
    }


def test_ac_trades_activations_for_recompute(reference):
    plain, tokens, *_ = reference
    stats = {"none": forward_backward_stats(copy.deepcopy(plain), tokens)}
    for mode, cfg in MODES.items():
        model = copy.deepcopy(plain)
        apply_ac(model, cfg)
        stats[mode] = forward_backward_stats(model, tokens)
    none, full, op, every2 = stats["none"], stats["full"], stats["selective-op"], stats["selective-every-2"]
    # Full AC reruns every block's forward in backward (up to the last op backward needs: a block's
    # output projection w2 is not rerun), every 2nd block half as many; both keep fewer activations.
    assert none["attention"] == 0 and full["attention"] == TINY.n_layers and every2["attention"] == TINY.n_layers // 2
    assert full["mm"] == none["mm"] + 6 * TINY.n_layers and every2["mm"] == none["mm"] + 3 * TINY.n_layers, stats
    assert full["saved"] < every2["saved"] < none["saved"], stats
    # Op-level: attention outputs and every other matmul's output are kept, the rest recomputed.
    assert op["attention"] == 0 and none["mm"] < op["mm"] < full["mm"], stats
    assert op["saved"] < none["saved"], stats


def test_op_policy_saves_every_other_matmul_and_attention():
    policy = ac._op_policy()

    class Ctx:
        def __init__(self, is_recompute):
            self.is_recompute = is_recompute

    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    forward = [policy(Ctx(False), op) for op in (mm, mm, mm, attention, add)]
    assert forward == [
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    ]
    # The recompute pass counts its own matmuls, so it makes the same choices.
    assert [policy(Ctx(True), op) for op in (mm, mm, mm)] == forward[:3]


def test_op_policy_sees_the_model_ops(reference, monkeypatch):
    """The ops the policy must save really occur in a block's forward on this machine."""
    plain, tokens, *_ = reference
    seen = set()
    make_policy = ac._op_policy

    def spying_policy():
        inner = make_policy()

        def policy(ctx, func, *args, **kwargs):
            seen.add(func)
            return inner(ctx, func, *args, **kwargs)

        return policy

    monkeypatch.setattr(ac, "_op_policy", spying_policy)
    model = copy.deepcopy(plain)
    apply_ac(model, MODES["selective-op"])
    loss_and_grads(model, tokens)
    assert torch.ops.aten.mm.default in seen
    assert seen & ac._SAVE_OPS - {torch.ops.aten.mm.default}, "no attention op among the saved ops"
