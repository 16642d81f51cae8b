"""torch.compile per block (the loss's compile is in titanlite/loss.py).

Blocks are compiled one by one rather than the whole model: the blocks are identical, so dynamo
traces one graph and every block reuses it, and compile time stays that of a single block.
Each block's `forward` is replaced by its compiled version in place, which keeps the module
tree (and so the FQNs) unchanged and leaves FSDP's hooks, which run around `forward`, eager.
"""

import functools

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from titanlite.config_sections import Compile
from titanlite.log import logger


def apply_compile(model: nn.Module, cfg: Compile, fullgraph: bool = True) -> None:
    """Compile every block of model.layers (after AC, so the checkpointing is traced too).

    fullgraph: a graph break inside a block would silently cost the speed-up, so it fails instead;
    expert parallelism passes False, its token dispatch (variable all-to-all splits read on the
    host) being run eagerly between the block's compiled parts (torch.compiler.disable on it)."""
    if not cfg.compiles("model"):
        return
    for block in model.layers.values():
        block.forward = _with_plain_input(torch.compile(block.forward, backend=cfg.backend, fullgraph=fullgraph))


def _with_plain_input(compiled_forward):
    """Under TP the first block's input is the embedding's reduce-scatter result, still pending (an
    AsyncCollectiveTensor). Handed to a compiled block as it is, the block's backward gives it no
    gradient (torch 2.13, gloo) and the embedding's backward fails; a copy waits for it and is a
    plain tensor (once per step, [batch, seq / tp, dim])."""

    @functools.wraps(compiled_forward)
    def forward(x, *args, **kwargs):
        return compiled_forward(x.clone() if isinstance(x, AsyncCollectiveTensor) else x, *args, **kwargs)

    return forward


def compile_without_disk_cache() -> None:
    """Inductor's on-disk caches (FX graphs, AOTAutograd) key a compiled graph by its mesh but not by
    the names of the process groups its collectives use, which shift when a run makes its groups in
    another order (another feature on, or a second run in one process). A cached graph then calls a
    group that does not exist, or another one. So under TP and EP, whose compiled code holds
    collectives, every start compiles afresh; FSDP's collectives stay outside the compiled code."""
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logger.info(
        "compile: inductor's on-disk cache is off under TP/EP (its entries name process groups); each start compiles "
        "afresh"
    )
