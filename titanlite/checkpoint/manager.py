"""CheckpointManager: DCP saves into <dump_folder>/<checkpoint.folder>/step-N, and resume.

A full checkpoint holds the objects of state.py, declared once in `self.objects` (save and load walk the
same dict): the model (its FQNs at the top level, sharded DTensors as they are: no rank ever gathers the
model), the optimizer, the lr schedule, the train state and lineage, the data-loader position and every
rank's RNG states. Model-only checkpoints (the seed checkpoint, a last_save_model_only export) hold just
the model's FQNs.

Async saves run in the background (async_save.py); a new save first waits for the previous one and
close() waits for the last. What each save cost the training steps it overlapped is measured by
`self.cost` (cost.py), which also logs it.
"""

import functools
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titanlite.checkpoint.async_save import AsyncSaver, Save
from titanlite.checkpoint.cost import SaveCost
from titanlite.checkpoint.fit import choose_load_step, holds_training_state, load_in_place, newest_resumable
from titanlite.checkpoint.folders import (
    METADATA,
    REWOUND,
    list_steps,
    purge_old,
    rewind_to,
    rewound_before,
    step_folder,
)
from titanlite.checkpoint.hf_io import copy_tokenizer, save_model_as_hf
from titanlite.checkpoint.integrity import CHECKSUMS, record_checksums, refuse_lost_metadata
from titanlite.checkpoint.lora import base_record, merge_lora, save_peft_adapter
from titanlite.checkpoint.save_errors import stop_if_disk_failure
from titanlite.checkpoint.state import (
    DataState,
    ModelState,
    OptimizerState,
    OuterOptimizerState,
    RngState,
    SavedKeys,
    SchedulerState,
    TrainState,
    TrainStateLineage,
    load_targets,
    restore_all,
    saved_state,
)
from titanlite.checkpoint.weights import ModelIdentity, check_dcp_checkpoint, load_weights
from titanlite.dtypes import DTYPES
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.metrics.profiling import model_state_bytes
from titanlite.models.lora import has_lora
from titanlite.run import Run, Training


class CheckpointManager:
    def __init__(self, run: Run, training: Training):
        """Checkpoints of build.py's `run` as its [checkpoint] section says, with the training state around it
        (`training`: the optimizer, the lr schedule, the data loader and the train state, which a load restores in
        place). Under fault tolerance one replica group writes each checkpoint (replicas.claims_save), and DiLoCo's
        outer SGD is saved beside the optimizer. What a save costs the steps is measured into the run's metrics."""
        self.cfg = cfg = run.cfg.checkpoint
        self.root = Path(run.cfg.job.dump_folder) / cfg.folder
        optimizer, replicas = training.optimizer, training.replicas
        self.model, self.optimizer = run.model, optimizer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # what every load checks (weights.py), and what Hugging Face exports are written by
        self.identity = ModelIdentity(run.label, run.spec.hf_adapter, run.args)
        # copied into Hugging Face exports
        self.tokenizer_file, self.chat_template = run.tokenizer.path, run.cfg.training.chat_template
        # LoRA: checkpoints hold the adapters; the base they were trained on is named in the train state.
        self.adapters_only = has_lora(run.model)
        self.base = (cfg.initial_load_path or "initialised from job.seed") if self.adapters_only else None
        self._base_record: str | None = None
        # the model's shape as config.json: `convert dcp-to-hf` exports a run whose shape is no registered flavor
        adapter = self.identity.hf_adapter
        model_config = json.dumps(adapter.hf_config(run.args)) if adapter else None
        self.lineage = TrainStateLineage(
            training.state,
            run.label,
            run.dims.dp_degree,
            self.world_size,
            self.base_record if self.adapters_only else None,
            model_config,
        )
        self.objects = {  # the checkpoint's keys, in the order a save writes them (the model's first: see _full_state)
            "model": ModelState(run.model, self.adapters_only),
            "optimizer": OptimizerState(run.model, optimizer),
            "lr_scheduler": SchedulerState(training.scheduler),
            "train_state": self.lineage,
            "dataloader": DataState(training.dataloader, run.dims.dp_rank, run.dims.dp_degree),
            "rng": RngState(self.rank, self.lineage),
        }
        outer_optimizer = replicas.outer_optimizer(run.model)
        if outer_optimizer is not None:
            self.objects["outer_optimizer"] = OuterOptimizerState(run.model, outer_optimizer)
        self.cost = SaveCost(training.metrics.write_scalars, warmup_steps=run.cfg.metrics.summary_warmup_steps)
        self.saver = None
        self.claims_save = replicas.claims_save  # one replica group writes each checkpoint
        saves = cfg.enable
        if saves and cfg.async_mode != "disabled":
            self.saver = AsyncSaver(pinned=cfg.async_mode == "async_with_pinned_mem", optimizer=optimizer)
        # Old checkpoints are deleted by rank 0 in the background, after a newer one completed.
        self.purger = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-purge") if self.rank == 0 and saves else None
        if saves:
            keep = f"keeping the newest {cfg.keep_latest_k}" if cfg.keep_latest_k else "keeping all"
            mode = {"disabled": "synchronous", "async": "async", "async_with_pinned_mem": "async, pinned memory"}[
                cfg.async_mode
            ]
            logger.info(f"checkpoints every {cfg.interval} steps into {self.root} ({mode} saves, {keep})")

    @property
    def state(self) -> TrainState:
        return self.lineage.state

    def _model_state(self, kind: str = "run") -> dict:
        return ModelState(self.model, self.adapters_only, kind).saved()

    def base_record(self) -> str:
        """The frozen base by path and content (lora.base_record), computed once: it never changes."""
        if self._base_record is None:
            self._base_record = base_record(self.base, self._model_state("base"))
        return self._base_record

    def _full_state(self) -> dict:
        # The model's first: FSDP's state_dict hook reshards a root that a validation forward (no
        # backward) left gathered; the optimizer's names are found from the sharded parameters.
        return saved_state(self.objects)

    def _export_state(self) -> dict:
        dtype = DTYPES[self.cfg.export_dtype]
        return {fqn: t.to(dtype) for fqn, t in self._model_state().items()}

    def maybe_save(self, step: int, *, last: bool = False, force: bool = False) -> None:
        """Save at every interval, at the last step and when forced (preemption); forced and last
        saves are waited for. The last step's save follows last_save_model_only / export_dtype
        and, with last_save_in_hf, also writes the model in Hugging Face format."""
        cfg = self.cfg
        self.poll()
        if force and not cfg.enable:
            logger.warning(f"stopping at step {step} without saving: checkpoint.enable is false")
        if cfg.enable and (force or last or self.saves_at(step)):
            if last and cfg.last_save_model_only and not force:
                self._save(step, self._export_state, wait=True, note=f"model only, {cfg.export_dtype}")
            else:
                self._save(step, self._full_state, wait=force or last)
        if last and cfg.last_save_in_hf and not cfg.enable:
            logger.warning(
                f"no Hugging Face export of step {step}: checkpoint.enable is false, which turns every save off "
                "(checkpoint.last_save_in_hf too); set checkpoint.enable true to write it"
            )
        elif last and cfg.last_save_in_hf:  # after the checkpoint: a failing export never costs the run's state
            self._save_hf(step)

    def saves_at(self, step: int) -> bool:
        """Whether the checkpoint interval saves this step (the last step and preemption save too)."""
        return self.cfg.enable and step % self.cfg.interval == 0

    def save_seed(self) -> None:
        """Step 0, model only: lets a large run start from weights initialised once, on one process."""
        if self.world_size != 1:
            raise UserError(
                f"checkpoint.create_seed_checkpoint runs on one process, not {self.world_size}; run it with "
                "plain python (no torchrun), then start the big run"
            )
        self._save(0, self._model_state, wait=True, note="seed checkpoint, model only")

    def _save(self, step: int, build_state, wait: bool, note: str = "") -> None:
        entered = time.perf_counter()
        previous = self.saver.pending if self.saver is not None else None
        self.wait()
        if previous is not None and previous.done_at > entered:  # it was still writing: this save waited for it
            self.cost.waited_for_previous(
                step, previous.step, previous.started, previous.done_at, entered, self.cfg.interval
            )
        path = step_folder(self.root, step)
        if self.claims_save is not None and not self.claims_save(path):  # another replica group writes it
            return
        if self.rank == 0:
            # Rewriting a step (a model-only final export when training goes on past it, a seed
            # checkpoint made again): its old .metadata must not vouch for half-written new files.
            shutil.rmtree(path / CHECKSUMS, ignore_errors=True)  # nor old checksums the new files (removed first:
            (path / METADATA).unlink(missing_ok=True)  # a record naming a missing .metadata means damage, integrity.py)
            try:  # before any file: a checkpoint without it cannot be verified (integrity.py)
                (path / CHECKSUMS).mkdir(parents=True)
            except OSError as error:
                self._stop_if_disk_failure(step, error)
                raise
        save = Save(step, time.perf_counter(), note=f" ({note})" if note else "")
        state = build_state()
        if wait or self.saver is None:
            try:
                dcp.save(state, checkpoint_id=str(path))
                record_checksums(path, self.rank)
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
        stop_if_disk_failure(
            error, self.root, step, (sizes["params"] + sizes["optimizer"]) * self.world_size, self.rank
        )

    def _save_hf(self, step: int) -> None:
        cfg = self.cfg
        path = self.root / f"step-{step}-hf"
        started = time.perf_counter()
        save_model_as_hf(
            self._model_state("all"),
            path,
            self.identity.hf_adapter,
            self.identity.args,
            DTYPES[cfg.export_dtype],
            writer_rank=self.rank == 0,
            merge=functools.partial(merge_lora, model=self.model),
        )
        if self.rank == 0 and self.tokenizer_file is not None:
            copy_tokenizer(self.tokenizer_file, path, self.chat_template)
        if self.adapters_only:
            save_peft_adapter(
                self._model_state(),
                self.root / f"step-{step}-peft",
                self.identity.hf_adapter,
                self.identity.args,
                self.model,
                self.base,
                writer_rank=self.rank == 0,
            )
            if self.rank == 0 and self.tokenizer_file is not None:
                copy_tokenizer(
                    self.tokenizer_file, self.root / f"step-{step}-peft", self.chat_template, generation=False
                )
        logger.info(
            f"model saved in Hugging Face format ({cfg.export_dtype}) to {path} in {time.perf_counter() - started:.2f}s"
        )

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
                refuse_lost_metadata(folder)
                logger.warning(f"skipping {folder}: it has no {METADATA}, so its save never finished")
            load_step = self._load_step()
            if load_step != -1:
                rewind_to(self.root, choose_load_step(self.root, complete, load_step), self.rank)
            chosen = load_step if load_step != -1 else newest_resumable(self.root, complete)
            if chosen is not None:
                if self.adapters_only:  # the frozen base first: the checkpoint holds only the adapters
                    self._load_initial()
                self._load_dcp(step_folder(self.root, chosen), resume=True)
                return self.state
        self._load_initial()
        return self.state

    def _load_step(self) -> int:
        """checkpoint.load_step, once: where this run rewound to that step already, the newest checkpoint."""
        step, rewound_at = self.cfg.load_step, rewound_before(self.root, self.cfg.load_step)
        if step == -1 or rewound_at is None:
            return step
        logger.warning(
            f"checkpoint.load_step {step} rewound this run once already ({rewound_at}), so this start resumes from the "
            f"newest checkpoint; remove load_step from the command or config.toml (or delete {self.root / REWOUND} to "
            f"rewind to step {step} again)"
        )
        return -1

    def _load_initial(self, resume: bool = True) -> None:
        """checkpoint.initial_load_path, if given: a Hugging Face folder or a DCP checkpoint (its training state too
        where resume and not checkpoint.initial_load_model_only)."""
        cfg = self.cfg
        if not cfg.initial_load_path:
            return
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            load_weights(
                ModelState(self.model, self.adapters_only, "base"), path, self.identity, "checkpoint.initial_load_path"
            )
        else:
            self._load_dcp(path, resume=resume and not cfg.initial_load_model_only, kind="base")

    def _load_dcp(self, path: Path, resume: bool, kind: str = "run") -> None:
        started = time.perf_counter()
        model = ModelState(self.model, self.adapters_only, kind)
        key = "checkpoint.initial_load_path" if kind == "base" else "checkpoint.folder"
        metadata = check_dcp_checkpoint(
            path,
            model,
            self.identity,
            key,
            resume=resume,
            transplant=kind == "base",
            allow_unverified=self.cfg.allow_unverified,
        )
        keys = SavedKeys(metadata.state_dict_metadata, path)
        if not holds_training_state(metadata):
            resume = False  # a seed checkpoint or a model-only export: weights, then step 1
        elif resume and "train_state.step" not in keys:
            raise UserError(
                f"checkpoint {path} holds no titanlite train state; load it with checkpoint.initial_load_model_only "
                "true"
            )
        objects = {**self.objects, "model": model} if resume else {"model": model}
        targets = load_targets(objects, keys)
        restore_all(objects, load_in_place(path, targets))
        if not resume:
            logger.info(f"loaded the model (weights only) from {path} in {time.perf_counter() - started:.2f}s")
            return
        logger.info(
            f"resumed from {path} at step {self.state.step} ({self.state.tokens_seen:,} tokens seen) "
            f"in {time.perf_counter() - started:.2f}s"
        )
