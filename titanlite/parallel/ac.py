"""Activation checkpointing per block: full, every N-th block, or op-level selective.

Each block in model.layers is replaced, under the same key, by torch's CheckpointWrapper, whose
state-dict hooks strip its `_checkpoint_wrapped_module.` prefix, so model.state_dict() keys (and
checkpoints) are the same with and without AC.

Op-level selective AC saves the outputs of the expensive ops (every other matmul, attention,
reduce-scatter, max) and recomputes the cheap ones (norms, activations, elementwise) in
backward: most of full AC's memory saving for a fraction of its recompute.
"""

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config_sections import ActivationCheckpoint


def _ops(namespace, names: tuple[str, ...]) -> set:
    """The ops of these names this torch build has (attention kernels differ between versions)."""
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


# Outputs worth keeping: expensive to recompute, and (for max) the amax that float8 scaling needs.
_SAVE_OPS = (
    _ops(
        torch.ops.aten,
        (
            "mm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "max",
        ),
    )
    | _ops(torch.ops._c10d_functional, ("reduce_scatter_tensor",))
    | {
        torch.ops.higher_order.flex_attention,  # block-causal attention on CUDA (models/attention.py)
    }
)
_MM = torch.ops.aten.mm.default


def _op_policy():
    """Save every op in _SAVE_OPS except every second matmul, recompute the rest.

    The matmul count runs separately for the forward and for the recompute in backward, so both
    passes make the same choice for the same matmul.
    """
    mm_count = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func == _MM:
            mm_count[ctx.is_recompute] += 1
            if mm_count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_level_context():
    # A fresh policy (and matmul count) for every checkpointed forward.
    return create_selective_checkpoint_contexts(_op_policy())


def every_nth(option: str) -> int | None:
    """selective_ac_option as an integer N, None for "op" (the config loader has checked it)."""
    return None if option == "op" else int(option)


def _wrap(block: nn.Module, **kwargs) -> nn.Module:
    # Blocks draw no random numbers (no dropout), so the RNG state need not be saved and replayed.
    return checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    """Wrap model.layers' blocks in place: full (every block), selective with an integer N (blocks
    N-1, 2N-1, ... i.e. every N-th block, fully), or selective "op" (every block, op-level policy)."""
    if cfg.mode == "none":
        return
    every = every_nth(cfg.selective_ac_option) if cfg.mode == "selective" else 1
    for index, key in enumerate(list(model.layers.keys())):
        block = model.layers[key]
        if every is None:
            model.layers[key] = _wrap(block, context_fn=_op_level_context)
        elif (index + 1) % every == 0:
            model.layers[key] = _wrap(block)
