"""CheckpointManager: DCP saves into <dump_folder>/<checkpoint.folder>/step-N, and resume.

A full checkpoint holds the model (its FQNs at the top level, sharded DTensors as they are: no
rank ever gathers the model), the optimizer, the lr schedule, the train state, the data-loader position (one per
data-parallel rank for raw data, one global count for a token store or mix) and every rank's RNG states. Model-only checkpoints
(the seed checkpoint, a last_save_model_only export) hold just the model's FQNs.

Async saves run in the background (async_save.py); a new save first waits for the previous one and
close() waits for the last. What each save cost the training steps it overlapped is measured by
`self.cost` (cost.py), which also logs it.
"""

import functools
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.checkpoint.cost import SaveCost
from titanlite.checkpoint.fit import (check_model_fits, choose_load_step, holds_training_state, load_in_place, newest_resumable,
                                     read_metadata, rng_state, set_rng_state)
from titanlite.checkpoint.folders import METADATA, is_complete, list_steps, purge_old, rewind_to, step_folder
from titanlite.checkpoint.hf_io import copy_tokenizer, load_model_from_hf, save_model_as_hf
from titanlite.checkpoint.async_save import AsyncSaver, Save
from titanlite.parallel.pp import tied_state_as_one_process, tied_state_as_stage, ties_embeddings
from titanlite.checkpoint.save_errors import stop_if_disk_failure
from titanlite.config_sections import Checkpoint
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.lora import check_same_base, has_lora, is_adapter, merge_lora, save_peft_adapter
from titanlite.dtypes import DTYPES
from titanlite.profiling import model_state_bytes

@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # over all data-parallel ranks


class CheckpointManager:
    def __init__(self, cfg: Checkpoint, dump_folder: str, *, model, optimizer, lr_scheduler, dataloader,
                 dp_rank: int, dp_degree: int, model_name: str, model_args, hf_adapter, cost: SaveCost | None = None,
                 tokenizer_file: Path | None = None):
        self.cfg = cfg
        self.root = Path(dump_folder) / cfg.folder
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        # A token-store loader's position is one global count; any other (StatefulDataLoader) is per rank.
        self.global_data = getattr(dataloader, "state_is_global", False)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model_name, self.model_args, self.hf_adapter = model_name, model_args, hf_adapter
        self.tokenizer_file = tokenizer_file  # copied into Hugging Face exports
        # LoRA: checkpoints hold the adapters; the base they were trained on is named in the train state.
        self.adapters_only, self.base = has_lora(model), cfg.initial_load_path or "initialised from job.seed"
        self.state = TrainState()
        self.cost = cost or SaveCost()
        self.saver = None
        self.writer = None  # [fault_tolerance]: path -> whether this replica group writes that checkpoint
        if cfg.enable and cfg.async_mode != "disabled":
            self.saver = AsyncSaver(pinned=cfg.async_mode == "async_with_pinned_mem", optimizer=optimizer)
        # Old checkpoints are deleted by rank 0 in the background, after a newer one completed.
        self.purger = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-purge") if self.rank == 0 else None
        if cfg.enable:
            keep = f"keeping the newest {cfg.keep_latest_k}" if cfg.keep_latest_k else "keeping all"
            mode = {"disabled": "synchronous", "async": "async", "async_with_pinned_mem": "async, pinned memory"}[cfg.async_mode]
            logger.info(f"checkpoints every {cfg.interval} steps into {self.root} ({mode} saves, {keep})")

    def _model_state(self, kind: str = "run") -> dict:
        """The model's tensors: "run" what its checkpoints hold (under LoRA the adapters only), "base" what an
        initial load fills (under LoRA all but the adapters), "all" both."""
        if not self.adapters_only or kind == "all":
            return get_model_state_dict(self.model)
        if kind == "run":
            return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=True))
        return {fqn: t for fqn, t in get_model_state_dict(self.model).items() if not is_adapter(fqn)}

    def _train_state(self) -> dict:
        return {
            "step": self.state.step, "tokens_seen": self.state.tokens_seen, "model": self.model_name,
            "dp_degree": self.dp_degree, "world_size": self.world_size, **({"base": self.base} if self.adapters_only else {}),
        }

    def _full_state(self) -> dict:
        # The model's first: FSDP's state_dict hook reshards a root that a validation forward (no
        # backward) left gathered; the optimizer's names are found from the sharded parameters.
        model = self._model_state()
        optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        tied_state_as_one_process(optimizer, ties_embeddings(self.model))
        return {
            **model,
            "optimizer": optimizer,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": self._train_state(),
            "dataloader": {self._data_key(): pickle.dumps(self.dataloader.state_dict())},
            "rng": {f"rank_{self.rank}": rng_state()},
        }

    def _data_key(self) -> str:
        """Pickled, so DCP stores a position as one opaque value: one per data-parallel rank, or a
        single one (equal on every rank) for a global-order loader, which any layout loads."""
        return "global" if self.global_data else f"dp_rank_{self.dp_rank}"

    def _export_state(self) -> dict:
        dtype = DTYPES[self.cfg.export_dtype]
        return {fqn: t.to(dtype) for fqn, t in self._model_state().items()}

    def maybe_save(self, step: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every interval, at the last step and when forced (preemption); forced and last
        saves are waited for. The last step's save follows last_save_model_only / export_dtype
        and, with last_save_in_hf, also writes the model in Hugging Face format."""
        cfg = self.cfg
        self.poll()
        if last and cfg.last_save_in_hf:
            self._save_hf(step)
        if force and not cfg.enable:
            logger.warning(f"stopping at step {step} without saving: checkpoint.enable is false")
        if not cfg.enable or not (force or last or self.saves_at(step)):
            return
        if last and cfg.last_save_model_only and not force:
            self._save(step, self._export_state, wait=True, note=f"model only, {cfg.export_dtype}")
        else:
            self._save(step, self._full_state, wait=force or last)

    def saves_at(self, step: int) -> bool:
        """Whether the checkpoint interval saves this step (the last step and preemption save too)."""
        return self.cfg.enable and step % self.cfg.interval == 0

    def save_seed(self) -> None:
        """Step 0, model only: lets a large run start from weights initialised once, on one process."""
        if self.world_size != 1:
            raise UserError(f"checkpoint.create_seed_checkpoint runs on one process, not {self.world_size}; run it with "
                            "plain python (no torchrun), then start the big run")
        self._save(0, self._model_state, wait=True, note="seed checkpoint, model only")

    def _save(self, step: int, build_state, wait: bool, note: str = "") -> None:
        entered = time.perf_counter()
        previous = self.saver.pending if self.saver is not None else None
        self.wait()
        if previous is not None and previous.done_at > entered:  # it was still writing: this save waited for it
            self.cost.waited_for_previous(step, previous.step, previous.started, previous.done_at, entered,
                                          self.cfg.interval)
        path = step_folder(self.root, step)
        if self.writer is not None and not self.writer(path):  # [fault_tolerance]: another replica group writes it
            return
        if self.rank == 0:
            # Rewriting a step (a model-only final export when training goes on past it, a seed
            # checkpoint made again): its old .metadata must not vouch for half-written new files.
            (path / METADATA).unlink(missing_ok=True)
        save = Save(step, time.perf_counter(), note=f" ({note})" if note else "")
        state = build_state()
        if wait or self.saver is None:
            try:
                dcp.save(state, checkpoint_id=str(path))
            except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
                self._stop_if_disk_failure(step, error)
                raise
            save.done_at = time.perf_counter()
            save.blocked = save.done_at - entered
            self._finished(save)
            return
        self.saver.start(save, state, path)
        save.blocked = time.perf_counter() - entered

    def _finished(self, save: Save) -> None:
        logger.info(
            f"checkpoint step-{save.step} saved in {save.done_at - save.started:.2f}s, "
            f"training blocked {save.blocked:.3f}s{save.note}"
        )
        self.cost.save_finished(save.step, save.started, save.done_at, save.blocked)
        if self.purger and self.cfg.keep_latest_k:
            self.purger.submit(purge_old, self.root, self.cfg.keep_latest_k)

    def poll(self) -> None:
        """Report an async save that has completed (cheap; called every step)."""
        if self.saver is not None and self.saver.finished():
            self.wait()

    def wait(self) -> None:
        """Block until the async save in flight (if any) is complete; re-raises its error."""
        if self.saver is None or self.saver.pending is None:
            return
        step = self.saver.pending.step
        try:
            save = self.saver.take()
        except (Exception, CheckpointException) as error:
            self._stop_if_disk_failure(step, error)
            raise
        self._finished(save)

    def _stop_if_disk_failure(self, step: int, error: BaseException) -> None:
        sizes = model_state_bytes(self.model, self.optimizer)
        stop_if_disk_failure(error, self.root, step, (sizes["params"] + sizes["optimizer"]) * self.world_size, self.rank)

    def _save_hf(self, step: int) -> None:
        cfg = self.cfg
        path = self.root / f"step-{step}-hf"
        started = time.perf_counter()
        save_model_as_hf(self._model_state("all"), path, self.hf_adapter, self.model_args, DTYPES[cfg.export_dtype],
                         writer_rank=self.rank == 0, merge=functools.partial(merge_lora, model=self.model))
        if self.rank == 0 and self.tokenizer_file is not None:
            copy_tokenizer(self.tokenizer_file, path)
        if self.adapters_only:
            save_peft_adapter(self._model_state(), self.root / f"step-{step}-peft", self.hf_adapter, self.model_args,
                              self.model, self.base, writer_rank=self.rank == 0)
        logger.info(f"model saved in Hugging Face format ({cfg.export_dtype}) to {path} in {time.perf_counter() - started:.2f}s")

    def close(self) -> None:
        """Wait for the last save and the purges; the job may exit after this."""
        try:
            self.wait()
            self.cost.flush()
        finally:
            if self.purger:
                self.purger.shutdown(wait=True)
            if self.saver is not None:
                self.saver.shutdown()

    def load(self) -> TrainState:
        """Resume from the newest complete checkpoint (or checkpoint.load_step); with none, start
        from initial_load_path if given. Returns the train state the loop continues from."""
        cfg = self.cfg
        if cfg.enable:
            complete, incomplete = list_steps(self.root)
            for folder in incomplete:
                logger.warning(f"skipping {folder}: it has no {METADATA}, so its save never finished")
            if cfg.load_step != -1:
                rewind_to(self.root, choose_load_step(self.root, complete, cfg.load_step), self.rank)
            chosen = cfg.load_step if cfg.load_step != -1 else newest_resumable(self.root, complete)
            if chosen is not None:
                if self.adapters_only:  # the frozen base first: the checkpoint holds only the adapters
                    self._load_initial()
                self._load_dcp(step_folder(self.root, chosen), resume=True)
                return self.state
        self._load_initial()
        return self.state

    def _load_initial(self) -> None:
        """checkpoint.initial_load_path, if given: a Hugging Face folder or a DCP checkpoint."""
        cfg = self.cfg
        if not cfg.initial_load_path:
            return
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            load_model_from_hf(self._model_state("base"), path, self.hf_adapter, self.model_args, self.model_name)
            logger.info(f"loaded the model from the Hugging Face folder {path}")
        else:
            if not is_complete(path):
                raise UserError(f"checkpoint.initial_load_path {path} is not a complete DCP checkpoint (no {METADATA} in it)")
            self._load_dcp(path, resume=not cfg.initial_load_model_only, kind="base")

    def _load_dcp(self, path: Path, resume: bool, kind: str = "run") -> None:
        started = time.perf_counter()
        metadata = read_metadata(path)
        keys = metadata.state_dict_metadata
        saved_from = ""
        if "train_state.model" in keys:
            saved_from = load_in_place(path, {"train_state": {"model": ""}})["train_state"]["model"]
        model_state = self._model_state(kind)
        # Pipeline stages each hold a share of the model: the checkpoint must fit the union of the ranks' shares.
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, {fqn: tuple(t.shape) for fqn, t in model_state.items()})
        check_model_fits(metadata, {fqn: shape for share in shares for fqn, shape in share.items()}, path, self.model_name, saved_from)
        if saved_from and saved_from != self.model_name:  # the same shapes, another model
            if resume:
                raise UserError(
                    f"checkpoint {path} was saved from {saved_from}, but this run is {self.model_name}; set model.name and "
                    f"model.flavor to {saved_from}, or start the new model from those weights with checkpoint.initial_load_path "
                    f"{path} and checkpoint.initial_load_model_only true in another job.dump_folder"
                )
            logger.warning(f"loading the weights of {saved_from} from {path} into {self.model_name} (checkpoint.initial_load_model_only)")
        if not holds_training_state(metadata):
            resume = False  # a seed checkpoint or a model-only export: weights, then step 1
        elif resume and "train_state.step" not in keys:
            raise UserError(f"checkpoint {path} holds no titanlite train state; load it with checkpoint.initial_load_model_only true")

        if not resume:
            load_in_place(path, model_state)
            set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=not self.adapters_only))
            logger.info(f"loaded the model (weights only) from {path} in {time.perf_counter() - started:.2f}s")
            return

        own_optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        own_groups = [group["params"] for group in own_optimizer["param_groups"]]
        ties = ties_embeddings(self.model)
        own_names = set(own_optimizer["state"])
        had_embedding = tied_state_as_one_process(own_optimizer, ties)
        state = {
            **model_state,
            "optimizer": own_optimizer,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": {"step": 0, "tokens_seen": 0, "dp_degree": 0, "world_size": 0, **({"base": ""} if self.adapters_only else {})},
        }
        data_key = self._data_key()
        saved_dp = sum(k.startswith("dataloader.dp_rank_") for k in keys)
        data_kind_changed = ("dataloader.global" in keys) != self.global_data
        if data_kind_changed:
            raise UserError(
                f"checkpoint {path} holds a data position for {'a token store or mix' if 'dataloader.global' in keys else 'raw data'}, "
                "but this run reads the other kind; resume with the training.dataset_path or dataset_mix it was saved with"
            )
        same_data_split = f"dataloader.{data_key}" in keys and (data_key == "global" or saved_dp == self.dp_degree)
        if same_data_split:
            state["dataloader"] = {data_key: b""}
        rng_key, own_rng = f"rng.rank_{self.rank}", rng_state()
        same_ranks = all(f"{rng_key}.{device}" in keys for device in own_rng)
        if same_ranks:
            state["rng"] = {f"rank_{self.rank}": own_rng}
        load_in_place(path, state)

        if self.adapters_only:
            check_same_base(state["train_state"]["base"], self.base, path)
        set_model_state_dict(self.model, {k: state[k] for k in model_state}, options=StateDictOptions(strict=not self.adapters_only))
        # The saved groups list one rank's parameter names; a pipeline's ranks list different ones, and
        # torch picks a tied matrix's state by the names listed: keep this layout's own lists.
        for group, names in zip(state["optimizer"]["param_groups"], own_groups):
            group["params"] = names
        tied_state_as_stage(state["optimizer"], ties, own_names, had_embedding)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        train_state = state["train_state"]
        self.state = TrainState(train_state["step"], train_state["tokens_seen"])
        if same_data_split:
            self.dataloader.load_state_dict(pickle.loads(state["dataloader"][data_key]))
        else:
            logger.warning(
                f"the data loader restarts its stream from the beginning: the data-parallel degree changed from "
                f"{saved_dp} to {self.dp_degree}, and each saved position belongs to the old split of the data "
                "(a token store from python -m titanlite.data.prepare resumes at any degree)"
            )
        if same_ranks:
            set_rng_state(state["rng"][f"rank_{self.rank}"])
        else:
            logger.info(f"RNG states not restored: the checkpoint comes from {train_state['world_size']} ranks, this run has {self.world_size}")
        logger.info(
            f"resumed from {path} at step {self.state.step} ({self.state.tokens_seen:,} tokens seen) "
            f"in {time.perf_counter() - started:.2f}s"
        )
