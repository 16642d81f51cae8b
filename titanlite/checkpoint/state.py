"""What a checkpoint holds, declared once: one object per top-level key, each saving and loading itself.

The checkpoint manager saves by asking every object for its state, and loads by asking each for a target
of the right shapes (DCP loads in place), then handing it back what was read. So a key is written in one
place, and a save and a load can never disagree about it.

    model         the model's FQNs at the top level (as in torchtitan), sharded DTensors as they are;
                  under LoRA the adapters only ("run"), or the frozen base ("base", an initial load)
    optimizer     the optimizer's state by parameter FQN; a pipeline's tied output copy under the embedding's
    outer_optimizer  DiLoCo's outer SGD momentum by parameter FQN (fault_tolerance.semi_sync_method diloco only)
    lr_scheduler  the lr schedule's position
    train_state   step and tokens seen, and the run's lineage: its model, degrees and LoRA base
    dataloader    the data position: one per data-parallel rank for raw data, one global count for a
                  token store or mix (which any layout loads)
    rng           every rank's RNG states, restored where the ranks are the same
"""

import pickle
from typing import Callable

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.checkpoint.fit import rng_state, set_rng_state
from titanlite.checkpoint.lora import check_same_base
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.models.lora import is_adapter
from titanlite.run import TrainState


class ModelState:
    """The model's tensors: "run" what its checkpoints hold (under LoRA the adapters only), "base" what an
    initial load fills (under LoRA all but the adapters), "all" both."""

    top_level = True  # its keys are the FQNs themselves

    def __init__(self, model, adapters_only: bool, kind: str = "run"):
        self.model, self.adapters_only, self.kind = model, adapters_only, kind
        self.loading = None

    def saved(self) -> dict:
        if not self.adapters_only or self.kind == "all":
            return get_model_state_dict(self.model)
        if self.kind == "run":
            return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=True))
        return {fqn: t for fqn, t in get_model_state_dict(self.model).items() if not is_adapter(fqn)}

    def target(self, keys) -> dict:
        if self.loading is None:  # once per load: the shape check and the load share it
            self.loading = self.saved()
        return self.loading

    def restore(self, state: dict) -> None:
        set_model_state_dict(
            self.model,
            {fqn: state[fqn] for fqn in self.loading},
            options=StateDictOptions(strict=not self.adapters_only),
        )


def ties_embeddings(model) -> bool:
    return getattr(getattr(getattr(model, "parts", [model])[0], "args", None), "tie_embeddings", False)


class OptimizerState:
    """A pipeline's last-stage copy of a tied matrix keeps its optimizer state under `output.weight`, a
    1-process model (one parameter) under `tok_embeddings.weight`: checkpoints use the latter, which the
    first stage writes with the same values, so they load under any layout."""

    top_level = False
    key = "optimizer"

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.ties = model, optimizer, ties_embeddings(model)

    def _as_one_process(self, state: dict) -> bool:
        """Renames in place; returns whether this rank held the embedding itself."""
        by_name = state["state"]
        had_embedding = "tok_embeddings.weight" in by_name
        if self.ties and "output.weight" in by_name:
            by_name.setdefault("tok_embeddings.weight", by_name.pop("output.weight"))
        return had_embedding

    def saved(self) -> dict:
        state = get_optimizer_state_dict(self.model, self.optimizer)
        self._as_one_process(state)
        return state

    def target(self, keys) -> dict:
        own = get_optimizer_state_dict(self.model, self.optimizer)
        self.own_groups = [group["params"] for group in own["param_groups"]]
        self.own_names = set(own["state"])
        self.had_embedding = self._as_one_process(own)
        return own

    def restore(self, state: dict) -> None:
        loaded = state[self.key]
        # The saved groups list one rank's parameter names; a pipeline's ranks list different ones, and
        # torch picks a tied matrix's state by the names listed: keep this layout's own lists.
        for group, names in zip(loaded["param_groups"], self.own_groups):
            group["params"] = names
        by_name = loaded["state"]
        if self.ties and "output.weight" in self.own_names and "tok_embeddings.weight" in by_name:
            by_name["output.weight"] = {
                k: v.clone() if torch.is_tensor(v) else v for k, v in by_name["tok_embeddings.weight"].items()
            }
            if not self.had_embedding:
                del by_name["tok_embeddings.weight"]
        set_optimizer_state_dict(self.model, self.optimizer, loaded)


class OuterOptimizerState(OptimizerState):
    """DiLoCo's outer SGD (fault_tolerance/diloco.py), kept as the optimizer is. A checkpoint saved without DiLoCo has
    none:
    the outer momentum then starts from zero, and the log says so."""

    key = "outer_optimizer"

    def target(self, keys) -> dict | None:
        if not any(fqn.startswith(f"{self.key}.") for fqn in keys):
            logger.info(f"checkpoint {keys.path} holds no DiLoCo outer optimizer: its momentum starts from zero")
            return None
        return super().target(keys)

    def restore(self, state: dict) -> None:
        if self.key in state:
            super().restore(state)


class SchedulerState:
    top_level = False

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def saved(self) -> dict:
        return self.scheduler.state_dict()

    def target(self, keys) -> dict:
        return self.saved()

    def restore(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["lr_scheduler"])


class TrainStateLineage:
    """The loop's position (step, tokens seen) and where the run comes from: its model, its degrees, and
    under LoRA the base the adapters were trained on (a resume must be on the same base)."""

    top_level = False

    def __init__(
        self,
        state: TrainState,
        model_name: str,
        dp_degree: int,
        world_size: int,
        base: Callable[[], str] | None,
        model_config: str | None = None,
    ):
        """`state`: the run's train state, which a load restores in place; `base`: the LoRA base's record
        (lora.base_record: path and content), None without LoRA; `model_config`: the model's shape as HF config.json
        text, which `convert dcp-to-hf` exports by."""
        self.model_name, self.dp_degree, self.world_size, self.base = model_name, dp_degree, world_size, base
        self.model_config = model_config
        self.state = state
        self.saved_world_size = world_size

    def saved(self) -> dict:
        return {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "model": self.model_name,
            "dp_degree": self.dp_degree,
            "world_size": self.world_size,
            **({"base": self.base()} if self.base is not None else {}),
            **({"model_config": self.model_config} if self.model_config is not None else {}),
        }

    def target(self, keys) -> dict:
        self.path = keys.path
        return {
            "step": 0,
            "tokens_seen": 0,
            "dp_degree": 0,
            "world_size": 0,
            **({"base": ""} if self.base is not None else {}),
        }

    def restore(self, state: dict) -> None:
        loaded = state["train_state"]
        if self.base is not None:
            check_same_base(loaded["base"], self.base(), self.path)
        self.state.step, self.state.tokens_seen = loaded["step"], loaded["tokens_seen"]
        self.saved_world_size = loaded["world_size"]


class DataState:
    """Pickled, so DCP stores a position as one opaque value: one per data-parallel rank, or a single one
    (equal on every rank) for a global-order loader, which any layout loads."""

    top_level = False

    def __init__(self, dataloader, dp_rank: int, dp_degree: int):
        self.dataloader, self.dp_rank, self.dp_degree = dataloader, dp_rank, dp_degree
        # A token-store loader's position is one global count; any other (StatefulDataLoader) is per rank.
        self.global_data = getattr(dataloader, "state_is_global", False)
        self.key = "global" if self.global_data else f"dp_rank_{dp_rank}"

    def saved(self) -> dict:
        return {self.key: pickle.dumps(self.dataloader.state_dict())}

    def target(self, keys) -> dict | None:
        self.saved_dp = sum(k.startswith("dataloader.dp_rank_") for k in keys)
        if ("dataloader.global" in keys) != self.global_data:
            raise UserError(
                f"checkpoint {keys.path} holds a data position for "
                f"{'a token store or mix' if 'dataloader.global' in keys else 'raw data'}, but this run reads the "
                "other "
                "kind; resume with the training.dataset_path or dataset_mix it was saved with"
            )
        same_split = f"dataloader.{self.key}" in keys and (self.global_data or self.saved_dp == self.dp_degree)
        # A loader whose position is global though its state is per rank (GRPO's prompts) takes rank 0's position
        self.from_rank_0 = (
            not same_split and hasattr(self.dataloader, "load_position") and "dataloader.dp_rank_0" in keys
        )
        return {self.key: b""} if same_split else {"dp_rank_0": b""} if self.from_rank_0 else None

    def restore(self, state: dict) -> None:
        if "dataloader" in state and self.from_rank_0:
            self.dataloader.load_position(pickle.loads(state["dataloader"]["dp_rank_0"]), self.saved_dp)
            return
        if "dataloader" in state:
            self.dataloader.load_state_dict(pickle.loads(state["dataloader"][self.key]))
            return
        logger.warning(
            f"the data loader restarts its stream from the beginning: the data-parallel degree changed from "
            f"{self.saved_dp} to {self.dp_degree}, and each saved position belongs to the old split of the data "
            "(a token store from python -m titanlite.data.prepare resumes at any degree)"
        )


class RngState:
    top_level = False

    def __init__(self, rank: int, lineage: TrainStateLineage):
        self.key, self.lineage = f"rank_{rank}", lineage

    def saved(self) -> dict:
        return {self.key: rng_state()}

    def target(self, keys) -> dict | None:
        own = rng_state()
        return {self.key: own} if all(f"rng.{self.key}.{device}" in keys for device in own) else None

    def restore(self, state: dict) -> None:
        if "rng" in state:
            set_rng_state(state["rng"][self.key])
        else:
            logger.info(
                f"RNG states not restored: the checkpoint comes from {self.lineage.saved_world_size} ranks, "
                f"this run has {self.lineage.world_size}"
            )


class SavedKeys(dict):
    """A checkpoint's metadata keys, knowing the folder they come from (for the sentences that name it)."""

    def __init__(self, keys, path):
        super().__init__(keys)
        self.path = path


def saved_state(objects: dict) -> dict:
    """What a save writes: every object's state under its key (the model's at the top level)."""
    state = {}
    for key, item in objects.items():
        if item.top_level:
            state.update(item.saved())
        else:
            state[key] = item.saved()
    return state


def load_targets(objects: dict, keys: SavedKeys) -> dict:
    """Every object's target for DCP's load in place; an object whose state this checkpoint does not hold
    for this layout (another data split, other ranks) gives none, and restores without it."""
    targets = {}
    for key, item in objects.items():
        target = item.target(keys)
        if item.top_level:
            targets.update(target)
        elif target is not None:
            targets[key] = target
    return targets


def restore_all(objects: dict, loaded: dict) -> None:
    """Hands every object what was read; the train state first, whose lineage checks come before any change."""
    for key in sorted(objects, key=lambda key: key != "train_state"):
        objects[key].restore(loaded)
