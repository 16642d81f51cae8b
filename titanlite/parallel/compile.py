"""torch.compile per block (the loss's compile is in titanlite/loss.py).

Blocks are compiled one by one rather than the whole model: the blocks are identical, so dynamo
traces one graph and every block reuses it, and compile time stays that of a single block.
Each block's `forward` is replaced by its compiled version in place, which keeps the module
tree (and so the FQNs) unchanged and leaves FSDP's hooks, which run around `forward`, eager.
"""

import torch
from torch import nn

from titanlite.config_sections import Compile


def compiles(cfg: Compile, component: str) -> bool:
    """compile.components holds only known names: the config checks them against its choices."""
    return cfg.enable and component in cfg.components


def apply_compile(model: nn.Module, cfg: Compile, fullgraph: bool = True) -> None:
    """Compile every block of model.layers (after AC, so the checkpointing is traced too).

    fullgraph: a graph break inside a block would silently cost the speed-up, so it fails instead;
    expert parallelism passes False, its token dispatch (variable all-to-all splits read on the
    host) being run eagerly between the block's compiled parts (torch.compiler.disable on it)."""
    if not compiles(cfg, "model"):
        return
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=cfg.backend, fullgraph=fullgraph)

