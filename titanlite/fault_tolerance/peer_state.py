"""A recovering replica group takes a live peer's state through the checkpoint's own state objects
(CheckpointManager.objects: model, optimizer, lr schedule, train state, data position, RNG, DiLoCo's outer
optimizer), so whatever a checkpoint restores, a recovery restores too, checked the same way.

The peer sends what each object would save, as each rank's local shards (rank r of every group holds the same
ones); the receiver asks its objects for their load targets, as a checkpoint load does, copies the peer's shards into
them in place (DCP's load does the same), and hands them back to the objects."""

import torch
from torch.utils._pytree import tree_map

from titanlite.checkpoint.state import ModelState, SavedKeys, load_targets, restore_all
from titanlite.checkpoint.weights import check_peer_model
from titanlite.models.init import local_tensor

PEER = "a live peer"  # where the state came from, in the objects' sentences


def peer_state(objects: dict) -> dict:
    """This group's live state for a recovering peer, one entry per checkpoint object (called on torchft's quorum
    thread while the loop waits for the quorum)."""
    return {key: tree_map(local_tensor, item.saved()) for key, item in objects.items()}


def load_peer_state(objects: dict, state: dict) -> None:
    """Restore every checkpoint object from a peer's peer_state(), as a checkpoint load would."""
    check_peer_model(state["train_state"]["model"], objects["train_state"].model_name)
    model = objects["model"]
    # a ModelState keeps its load target for the load it serves: each recovery asks a fresh one
    objects = {**objects, "model": ModelState(model.model, model.adapters_only, model.kind)}
    keys = SavedKeys({key: None for key in saved_keys(objects, state)}, PEER)
    targets = load_targets(objects, keys)
    loaded = {}
    for key, target in targets.items():
        loaded[key] = fill(target, state[key] if key in objects else state["model"][key])  # else a model FQN
    restore_all(objects, loaded)


def saved_keys(objects: dict, state: dict) -> list[str]:
    """The flat keys of a peer's state, as a checkpoint's metadata lists them (a top-level object's own keys)."""
    keys = []
    for key, value in state.items():
        keys += flat_keys(value, "" if objects[key].top_level else f"{key}.")
    return keys


def flat_keys(value, prefix: str) -> list[str]:
    if isinstance(value, dict):
        return [k for name, item in value.items() for k in flat_keys(item, f"{prefix}{name}.")]
    if isinstance(value, (list, tuple)):
        return [k for i, item in enumerate(value) for k in flat_keys(item, f"{prefix}{i}.")]
    return [prefix[:-1]]


def fill(target, source):
    """The target with the peer's values: its tensors (this rank's shards) copied into in place, the rest taken."""
    if isinstance(target, dict):
        return {key: fill(value, source[key]) for key, value in target.items()}
    if isinstance(target, list):
        return [fill(value, item) for value, item in zip(target, source)]
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            local_tensor(target).copy_(source)
        return target
    return source
