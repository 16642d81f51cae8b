"""Validation: loss and perplexity on held-out data every validation.freq steps.

The validator owns a loader of its own, built once: validating never moves the training data
position. Every validation restores that loader to its start, so it reads the same batches
each time (at most validation.steps per rank), with the model in eval mode and no autograd.

Data-parallel ranks hold different shares of the held-out data, so a finite pass can end
sooner on one rank than on another; with FSDP every rank must run every forward (each one
all-gathers parameters), so before each batch the ranks agree (all_reduce MIN) that all of them
still have one, and the pass stops for all when any rank runs out. The loss is the mean over
all tokens of all ranks: an all_reduce of (sum of token losses, token count).
"""

import functools
import time

import torch
import torch.distributed as dist

from titanlite.config_rules import check_context_parallel
from titanlite.config_sections import Training, Validation
from titanlite.data.batch import MicroBatch
from titanlite.data.datasets import DataSpec, build_dataloader, resolve_dataset
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.loss import loss_sum, trained_tokens
from titanlite.models.attention import document_ids
from titanlite.parallel.cp import sequence_shard, split_batch
from titanlite.parallel.fsdp import mixed_precision_context


def batch_shape(cfg: Validation, training: Training) -> tuple[int, int]:
    """(sequences per rank per batch, tokens per sequence), -1 taking training's value."""
    batch_size = cfg.local_batch_size if cfg.local_batch_size != -1 else training.local_batch_size
    return batch_size, cfg.seq_len if cfg.seq_len != -1 else training.seq_len


def validation_data(cfg: Validation, training: Training) -> DataSpec:
    """validation's data keys, training's format; a finite pass read in this process (no workers: a pass is
    short and a worker would be forked for each one)."""
    batch_size, seq_len = batch_shape(cfg, training)
    return DataSpec(
        cfg.dataset,
        cfg.dataset_path,
        seq_len,
        batch_size,
        text_field=training.dataset_text_field,
        infinite=False,
        section="validation",
        dataset_format=training.dataset_format,
        train_on=training.train_on,
        chat_template=training.chat_template,
        packing=training.packing,
    )


def check_validation(cfg: Validation, training: Training, max_seq_len: int) -> None:
    """Called before the model is built, so a mistake costs no time."""
    seq_len = batch_shape(cfg, training)[1]
    if seq_len > max_seq_len:
        raise UserError(
            f"validation.seq_len {seq_len} exceeds the model's context ({max_seq_len}); lower validation.seq_len"
        )


class Validator:
    def __init__(self, run, metrics):
        """Validation of build.py's `run` as its [validation] section says: its loss function (the chunked
        loss validates by chunks too), TP's loss parallel, document delimiters and pipeline as in training."""
        cfg, training = run.cfg.validation, run.cfg.training
        self.cfg = cfg
        self.loss_fn, self.loss_parallel = run.loss_fn, run.forward.loss_parallel
        self.pipeline = run.pipeline
        self.delimiters = run.forward.delimiters
        self.dims = dims = run.dims
        self.device = run.device
        self.param_dtype = training.mixed_precision_param
        self.metrics = metrics
        batch_size, seq_len = batch_shape(cfg, training)
        self.batch_size = batch_size
        check_context_parallel(seq_len, dims.cp, "validation.seq_len")
        self.shard = sequence_shard(seq_len, dims.cp_mesh, run.device) if dims.cp_enabled else None
        if run.pipeline is not None and (batch_size, seq_len) != (training.local_batch_size, training.seq_len):
            raise UserError(
                f"under pipeline parallelism validation runs the training schedule, so its batch of {batch_size} x "
                f"{seq_len} "
                f"tokens must be training's {training.local_batch_size} x {training.seq_len}; set "
                "validation.local_batch_size "
                "and validation.seq_len to -1"
            )
        self.loader = build_dataloader(
            validation_data(cfg, training), run.tokenizer, dims.dp_rank, dims.dp_degree, run.cfg.job.seed
        )
        self.start = self.loader.state_dict()
        name = f"validation.dataset_path {cfg.dataset_path}" if cfg.dataset_path else cfg.dataset
        reads = (resolve_dataset(cfg.dataset, cfg.dataset_path, "validation"), cfg.dataset_path)
        if reads == (resolve_dataset(training.dataset, training.dataset_path), training.dataset_path):
            logger.warning(
                f"validation reads the training data ({name}), so its loss cannot show overfitting; for held-out "
                "data use validation.dataset sample_val (for sample) or c4_val (for c4), or a validation.dataset_path"
            )
        batches = "all batches" if cfg.steps == -1 else f"up to {cfg.steps} batches"
        logger.info(
            f"validation every {cfg.freq} steps on {name}: {batches} of {batch_size} x {seq_len} tokens per rank"
        )

    def should_validate(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def _all_ranks_have(self, batch) -> bool:
        have = torch.tensor([batch is not None], dtype=torch.int32, device=self.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        return bool(have.item())

    def _loss_sum(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of this rank's token losses of the batch (a pipeline runs its schedule forward only) and
        its trained tokens (under context parallelism this rank's share of them)."""
        batch = MicroBatch.of(batch).on(self.device, functools.partial(document_ids, delimiters=self.delimiters))
        inputs, labels, model_kwargs = split_batch(batch.inputs, batch.labels, batch.document_ids, self.shard)
        context = mixed_precision_context(self.dims, self.param_dtype, self.device.type)  # one path enters it
        if self.pipeline is not None:
            with context:
                return self.pipeline.eval_loss_sum(inputs, labels, model_kwargs), trained_tokens(labels)
        return loss_sum(model, inputs, labels, model_kwargs, self.loss_fn, context, self.loss_parallel), trained_tokens(
            labels
        )

    @torch.no_grad()
    def validate(self, model, step: int) -> tuple[float, float]:
        """Mean loss per token over all ranks and its perplexity; logs them and writes TensorBoard."""
        started = time.perf_counter()
        self.loader.load_state_dict(self.start)  # from the beginning, whatever the last pass read
        batches = iter(self.loader)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        model.eval()
        try:
            while self.cfg.steps == -1 or count < self.cfg.steps:
                batch = next(batches, None)
                if self.pipeline is not None and batch is not None and len(batch[0]) < self.batch_size:
                    # The schedule splits every batch into the same microbatches: a short last one ends the pass.
                    logger.info(
                        f"validation leaves out a last batch of {len(batch[0])} sequences (pipeline batches are "
                        f"{self.batch_size})"
                    )
                    batch = None
                if not self._all_ranks_have(batch):
                    break
                batch_loss, batch_tokens = self._loss_sum(model, batch)
                loss_sum += batch_loss
                tokens += batch_tokens
                count += 1
        finally:
            model.train()
        totals = torch.stack([loss_sum, tokens])
        dist.all_reduce(totals)
        loss_total, token_total = totals.tolist()
        if token_total == 0:
            raise UserError(
                "validation read no batch: a data-parallel rank's share of the validation data holds no window of "
                "validation.seq_len + 1 tokens; lower validation.seq_len or use more held-out data"
            )
        loss = loss_total / token_total
        perplexity = torch.tensor(loss).exp().item()  # inf rather than an OverflowError for a diverged model
        # Every rank of a TP/PP group counted the group's tokens (and its loss sum): the ratio stands, the count is
        # once.
        tokens_once = int(token_total) // self.dims.model_parallel_degree
        self.metrics.log_validation(step, loss, perplexity, count, tokens_once, time.perf_counter() - started)
        return loss, perplexity
