"""Checkpoints: DCP save / resume (manager.py), preemption (stopping.py), Hugging Face files (hf_io.py)."""

from titanlite.checkpoint.manager import CheckpointManager
from titanlite.checkpoint.state import TrainState
from titanlite.checkpoint.stopping import StopFlags

__all__ = ["CheckpointManager", "StopFlags", "TrainState"]
