"""Every way titanlite computes the training loss, in one place.

- `cross_entropy_loss`: the mean next-token loss of the logits, in fp32.
- The chunked output loss (training.loss_chunk_tokens): the output projection and cross-entropy fused
  by chunks of tokens, run inside the model's forward.
- `build_loss`: which of the two a run uses, compiled where compile.components has "loss".
- Tensor parallelism's loss parallel: cross-entropy on vocab-sharded logits.
- `micro_batch_loss`: forward plus loss of one micro-batch, the one function the train step,
  validation and the planner run; `stage_loss`/`stage_forward`: the same for a pipeline's last stage.
- `LossScale`: how each micro-batch mean enters a step's loss (gradient accumulation, chat data's
  per-token weights, a pipeline's microbatches), so that the step is that of one process.

The chunked loss. The plain path makes the logits of the whole micro-batch, [N, vocab] in the compute
dtype, then their fp32 upcast and what cross_entropy keeps for backward: at Llama 3's vocabulary
(128,256) and 16k tokens that is 4 + 8 + 8 GB. Here the forward walks the tokens chunk by chunk: one
chunk's logits, upcast, its loss, and, when gradients are wanted, the loss's gradient w.r.t. those
logits (softmax - onehot) turned at once into the chunk's gradient of the hidden states and its share
of the output weight's gradient; backward only scales those by the incoming gradient. At most one
chunk's logits exist at a time. The matmuls are the same three as the plain path's (logits, grad of
h, grad of W), so the FLOPs are unchanged. The model runs it inside its forward
(KeepsTiedEmbeddings.head), where FSDP has gathered the output weight; a loss computed outside it
with model.output.weight would bypass FSDP's hooks. Every label is a real token (packing leaves no
padding), so the mean is over all N tokens.
"""

import contextlib
import dataclasses
import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.config_sections import Compile, Training

IGNORED = -100  # the label of a token outside the loss (cross_entropy's ignore_index)


def chunk_loss(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float | None = None):
    """(the sum of the chunk's token losses in fp32, the gradient of grad_scale x that sum w.r.t. the
    logits [C, V] in their dtype, or None without grad_scale). torch.compile'd where compile.components
    has "loss", so inductor fuses the upcast, softmax, onehot and scale of a chunk."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    loss = (lse - logits32.gather(-1, labels[:, None]).squeeze(-1)).sum()
    if grad_scale is None:
        return loss, None
    probs = logits32.sub_(lse[:, None]).exp_()  # in place: the chunk's fp32 logits are needed no more
    probs[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return loss, probs.mul_(grad_scale).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens, dtype, chunk_math, grad_enabled):
        # needs_input_grad says what requires grad, even under torch.no_grad (validation): ask both.
        wants_h, wants_weight = (grad_enabled and needs for needs in ctx.needs_input_grad[:2])
        n = h.shape[0]
        h_c, weight_c = h.to(dtype), weight.to(dtype)  # no copies where they are in the compute dtype already
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h_c) if wants_h else None
        # fp32 even when computing in bf16: each chunk's bf16 product is rounded once, and summing
        # many of them in bf16 would round the running total at every chunk.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk_sum, grad_logits = chunk_math(
                h_c[rows] @ weight_c.T, labels[rows], 1.0 / n if wants_h or wants_weight else None
            )
            loss += chunk_sum
            if wants_h:
                torch.mm(grad_logits, weight_c, out=grad_h[rows])
            if wants_weight:
                grad_weight.add_(grad_logits.T @ h_c[rows])
        ctx.save_for_backward(
            None if grad_h is None else grad_h.to(h.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
        )
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        return (
            None if grad_h is None else grad_h * grad_loss,
            None if grad_weight is None else grad_weight * grad_loss,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, chunk_math: Callable = chunk_loss
) -> torch.Tensor:
    """The mean fp32 cross-entropy of logits h @ weight.T against labels [N], chunk_tokens tokens at a
    time; h [N, D] are the final hidden states (after the norm), weight [V, D] the output projection.
    It computes in autocast's dtype where autocast is on (as nn.Linear would), else in the weight's."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):  # the dtypes are chosen above, explicitly
        return _LinearCrossEntropy.apply(h, weight, labels, chunk_tokens, dtype, chunk_math, torch.is_grad_enabled())


@dataclasses.dataclass(frozen=True)
class ChunkedCrossEntropy:
    """The trainer's loss where training.loss_chunk_tokens > 0: the model's forward computes it from
    its final hidden states (`output_loss`) in place of returning the logits."""

    chunk_tokens: int
    chunk_math: Callable = chunk_loss

    def against(self, labels: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(hidden states [N, D], output weight) -> the mean loss against labels [B, T]: the model's output_loss."""
        return functools.partial(
            chunked_cross_entropy, labels=labels.flatten(), chunk_tokens=self.chunk_tokens, chunk_math=self.chunk_math
        )


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the trained tokens, computed in fp32 whatever the compute dtype. Labels
        IGNORED (-100: chat data outside the trained turns) are left out of the sum and the count; text data
        has none, so its loss is the plain mean. Chat windows hold at least one trained label each
        (conversation_windows.py
    leaves out a conversation without one)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORED)


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels are in the loss (chat data leaves the untrained turns IGNORED)."""
    return (labels != IGNORED).sum()


@dataclasses.dataclass(frozen=True)
class LossScale:
    """How each micro-batch mean enters the step's loss, so that the loss and the gradients are those of
    one process holding the whole global batch, whatever the layout.

    Text trains on every token and each micro-batch holds as many (packed windows): every mean is divided
    by `means`, the number of means summed in a step (micro-steps x a pipeline's microbatches). Chat data
    trains on some tokens only: each mean is weighted by its trained tokens times `per_token`, the weight
    of one trained token (`per_trained_token`). An objective that computes its share of the global batch's loss
    itself (GRPO) has it multiplied by `share_degree`, what FSDP's gradient average divides by."""

    means: int
    per_token: torch.Tensor | None = None
    share_degree: int | None = None

    def apply(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss (against `labels`), or its share, as its share of the step's loss."""
        if self.share_degree is not None:
            return loss * self.share_degree
        if self.per_token is None:
            return loss / self.means
        return loss * (trained_tokens(labels) * self.per_token)

    def aux_term(self, aux_loss: torch.Tensor, coeff: float) -> torch.Tensor:
        """A micro-batch's balance loss (MoE) as its share of the step's, weighted by model.moe_aux_loss_coeff."""
        return coeff * aux_loss / self.means

    def aux_weight(self, coeff: float) -> float:
        """aux_term's factor, for a pipeline stage that sends it into the backward itself."""
        return coeff / self.means


def per_trained_token(labels: list[torch.Tensor], degree: int) -> torch.Tensor:
    """The weight of one trained token of the step: one over the trained tokens of the global batch
    (these micro-batches' labels, counted on every rank: each TP/PP group holds one batch, cp ranks their
    own shares), times `degree`, what FSDP's gradient average divides by times the ranks that share a batch
    (data-parallel x context-parallel x model-parallel ranks)."""
    total = torch.stack([trained_tokens(one) for one in labels]).float().sum().reshape(1)
    dist.all_reduce(total)
    return degree / total[0]


def maybe_compile_loss(loss_fn: Callable, cfg: Compile) -> Callable:
    return torch.compile(loss_fn, backend=cfg.backend) if cfg.compiles("loss") else loss_fn


def build_loss(cfg: Training, compile_cfg: Compile):
    """cross_entropy_loss of the logits, or with training.loss_chunk_tokens the chunked output projection +
    loss that the model's forward runs; compiled where compile.components has "loss" (the chunked one per
    chunk: its loop stays eager)."""
    if cfg.loss_chunk_tokens:
        return ChunkedCrossEntropy(cfg.loss_chunk_tokens, maybe_compile_loss(chunk_loss, compile_cfg))
    return maybe_compile_loss(cross_entropy_loss, compile_cfg)


def computed_in_forward(loss_fn) -> bool:
    """Whether the model's forward computes this loss itself (the chunked loss) instead of returning logits."""
    return isinstance(loss_fn, ChunkedCrossEntropy)


def loss_parallel_context(enabled: bool):
    """The loss (forward and backward) on vocab-sharded logits: cross-entropy's reductions become
    collectives over the TP ranks instead of a gather of the logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel returns a replicated DTensor; the rest of the step works on plain tensors."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def micro_batch_loss(
    model, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, loss_fn, forward_context
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the mean loss of a micro-batch (a plain tensor), the extra losses its forward returned: with_extra_losses),
    as the train step, validation and the planner run it; `model_kwargs` are the model's keyword inputs
    (document_ids, sequence_shard: parallel/cp.py's split_batch). The chunked loss runs inside the model's forward
    (under forward_context); any other loss_fn takes the logits after it (outside: activation offload is for the
    model's activations, not the loss's). Under loss parallel the caller holds loss_parallel_context over this and
    the backward."""
    if computed_in_forward(loss_fn):
        with forward_context:
            return model(inputs, output_loss=loss_fn.against(labels), extra_losses=True, **model_kwargs)
    with forward_context:
        logits, extra = model(inputs, extra_losses=True, **model_kwargs)
    return local_loss(loss_fn(logits, labels)), extra


def with_extra_losses(
    loss: torch.Tensor, extra: dict[str, torch.Tensor], scale: "LossScale", aux_loss_coeff: float
) -> torch.Tensor:
    """A micro-batch's share of the step's objective: its scaled loss plus the extra losses its forward returned,
    each as the same share: MoE's balance loss "moe_aux" weighted by model.moe_aux_loss_coeff, DeepSeek-V3's
    multi-token prediction "mtp" as the model weighted it (model.mtp_loss_weight)."""
    weights = {"moe_aux": aux_loss_coeff, "mtp": 1.0}
    for name, value in extra.items():
        loss = loss + scale.aux_term(value, weights[name])
    return loss


def stage_forward(forward, chunked_loss: ChunkedCrossEntropy | None, h, labels=None, **model_kwargs):
    """A pipeline stage's forward under the chunked loss: every stage receives its microbatch's labels; the
    last computes the loss from them inside its forward (where FSDP has gathered the output weight)."""
    if chunked_loss is None:
        return forward(h, **model_kwargs)
    return forward(h, output_loss=chunked_loss.against(labels), **model_kwargs).reshape(1)


def stage_loss(output: torch.Tensor, labels: torch.Tensor, loss_fn) -> torch.Tensor:
    """A microbatch's mean loss from the last pipeline stage's output: its logits, or with the chunked loss
    the loss itself (shape [1], which the schedule can concatenate over microbatches)."""
    return output.sum() if computed_in_forward(loss_fn) else local_loss(loss_fn(output, labels))


def loss_sum(
    model,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    model_kwargs: dict,
    loss_fn,
    forward_context,
    loss_parallel_enabled: bool,
) -> torch.Tensor:
    """The sum of a batch's token losses (validation, under no_grad): its mean times its trained tokens."""
    with loss_parallel_context(loss_parallel_enabled):
        return micro_batch_loss(model, inputs, labels, model_kwargs, loss_fn, forward_context)[0] * trained_tokens(
            labels
        )
