"""Activation memory of one rank, from the real forward and backward run on fake (meta-backed) tensors.

LiveBytes is a dispatch mode that tallies the bytes of every tensor storage created during the
step that is still alive, op by op, so it sees exactly what autograd saves and what each AC mode
keeps or recomputes (checkpoint wrappers, the op-level policy's cache). The tensors are CPU
FakeTensors, which pick the kernels a real run picks: scaled_dot_product_attention takes the
flash kernel, which, like the GPU's flash and memory-efficient kernels, saves the output and a
logsumexp per row (linear in seq_len), never the seq_len^2 scores.

Gradients: without FSDP each one stays as autograd made it; with FSDP the unsharded gradient
is reduce-scattered away at once (its transient is in the buffers), leaving this rank's shard.
Under tensor parallelism an activation is split over the tp ranks (sequence parallel outside attention,
heads inside), so the unsharded tally is divided by tp, but for what sequence parallelism holds whole on
every rank: each block's all-gathered inputs, its partial sums before their reduce-scatter and the
gradients of both, and the output projection's gathered input (count_sequence_gathers). Against a real
TP2 step counted on its local shards: within 10% with and without AC (tests/test_plan.py).

Under context parallelism the step runs the trainer's split (parallel/cp.py: split_batch with cp rank
0's positions; every rank holds 2 of the 2N chunks, so rank 0 stands for all): the blocks see T/N
tokens and each attention the whole window's keys and values, which `planned_shard`'s gather makes
from N copies of the rank's own instead of an all-gather (the same [B, kv_heads, T, D] buffer, then
GQA's repeat and the [T/N, T] attention, as in the real step; its backward sums the N copies' gradients
where the real one reduce-scatters them). The CPU builds the mask as a dense [T/N, T] boolean, a GPU as
a FlexAttention BlockMask of kilobytes: the tally leaves it out.

Compiled (`compiled=True`): the same eager step, tallied as inductor would keep it. A tensor made by
an op that AOTAutograd's min-cut partitioner may recompute (its list: pointwise ops, casts, views;
and, where the loss is compiled, the softmax family, which inductor decomposes into pointwise ops
and row reductions) costs nothing: the compiled graph recomputes it in backward from what it saves,
or fuses it away. What crosses a compiled region's edge is kept: each block's input, and the
gradients flowing back into each block and into the loss. What stays is what the partitioner
cannot recompute: matmul and attention outputs, those edges, the eager parts' tensors. It is a lower bound of a compiled
step's activations (the partitioner may keep
a cheap tensor where it is smaller than its inputs); the eager tally is the upper bound.
"""

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.config_sections import Compile, JobConfig
from titanlite.dtypes import DTYPES
from titanlite.loss import build_loss, micro_batch_loss
from titanlite.models.attention import GatheredKeys
from titanlite.models.init import local_tensor
from titanlite.models.lora import apply_lora
from titanlite.parallel.ac import apply_ac, every_nth
from titanlite.parallel.cp import SequenceShard, shard_of, split_batch
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import mixed_precision_context
from titanlite.parallel.pp import cut_to_stage
from titanlite.plan.moe import route_evenly

FULL_DEPTH_UP_TO = 8  # deeper models are measured at two depths and extrapolated (the blocks are identical)


def storage_of(tensor: torch.Tensor):
    """The tensor's storage; a DTensor's is its local shard's (the tally also counts real TP steps: tests/)."""
    return local_tensor(tensor).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes alive of the storages created under it: purge() says how many now, `peak` the most at any op of
    live / split + grads, where split is the tp degree and grads the sharded gradients counted apart."""

    def __init__(self, split: int, existing: list[torch.Tensor], recomputed: frozenset = frozenset()):
        super().__init__()
        self.split = split
        self.recomputed = recomputed  # ops whose outputs cost nothing (a compiled step recomputes them)
        # Views of tensors made before (parameters' transposes, RoPE slices) allocate nothing.
        self.existing = {storage_of(tensor)._cdata for tensor in existing}
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.ignored: dict[int, StorageWeakRef] = {}  # storages that cost nothing, nor what is made from them alone
        self.counted = self.added = self.peak = self.grads = 0  # counted: the bytes alive at the last purge

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from_ignored = self._made_from_ignored(args)
        counted = func.overloadpacket not in self.recomputed
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                if from_ignored:
                    self.ignore(tensor)
                else:
                    self._track(storage_of(tensor), counted)
        # What is alive is at most what was counted at the last purge plus what came since; only when that bound
        # passes the peak can the peak rise, so only then are the dead storages looked for (one by one: the
        # slow part of a tally).
        if (self.counted + self.added) // self.split + self.grads > self.peak:
            self.peak = max(self.peak, self.purge() // self.split + self.grads)
        return out

    def _track(self, storage, counted: bool = True) -> None:
        """A new storage costs its bytes, or nothing where `counted` is False; an op returning a storage
        already known (a view, detach, an in-place op) leaves its count as it was."""
        key = storage._cdata
        if key in self.existing:
            return
        known = self.storages.get(key)
        if known is None or known[0].expired():
            nbytes = storage.nbytes() if counted else 0
            self.storages[key] = (StorageWeakRef(storage), nbytes)
            self.added += nbytes

    def purge(self) -> int:
        """Forget the dead storages; return the bytes alive now."""
        expired = torch.Storage._expired  # what StorageWeakRef.expired calls, without its frame per storage
        dead = [key for key, (ref, _) in self.storages.items() if expired(ref.cdata)]
        for key in dead:
            del self.storages[key]
        for key in [key for key, ref in self.ignored.items() if ref.expired()]:
            del self.ignored[key]
        self.counted, self.added = sum(nbytes for _, nbytes in self.storages.values()), 0
        return self.counted

    def keep(self, tensor: torch.Tensor) -> None:
        """Count the tensor whatever op made it (a compiled region's input)."""
        self._count(tensor, 1)

    def unsplit(self, tensor: torch.Tensor) -> None:
        """Count the tensor whole on every tp rank (sequence parallelism gathers it whole), where every
        other tensor is divided by split; whatever op made it (a collective's output is no recomputable op)."""
        self._count(tensor, self.split)

    def _count(self, tensor: torch.Tensor, copies: int) -> None:
        """Count the tensor's storage as `copies` times its bytes, in place of what it counted."""
        storage = tensor.untyped_storage()
        if storage._cdata in self.existing:
            return
        ref, before = self.storages.get(storage._cdata, (None, 0))
        self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes() * copies)
        self.added += storage.nbytes() * copies - (0 if ref is None or ref.expired() else before)

    def forget(self, tensor: torch.Tensor) -> None:
        self.storages.pop(tensor.untyped_storage()._cdata, None)

    def ignore(self, tensor: torch.Tensor) -> None:
        """Count the tensor's storage as nothing while it lives, and whatever an op makes from it alone
        (SDPA's float copy of a boolean mask on the CPU)."""
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        self.ignored[storage._cdata] = ref
        self.storages[storage._cdata] = (ref, 0)

    def _made_from_ignored(self, args) -> bool:
        """Whether every input of more than one element is an ignored storage."""
        inputs = [arg for arg in pytree.tree_leaves(args) if isinstance(arg, torch.Tensor) and arg.numel() > 1]
        return bool(inputs) and all(self._is_ignored(storage_of(arg)._cdata) for arg in inputs)

    def _is_ignored(self, key: int) -> bool:
        ref = self.ignored.get(key)
        return ref is not None and not ref.expired()  # a dead one's address may be a new storage's


@dataclasses.dataclass(frozen=True)
class Activations:
    saved: int  # bytes alive at the end of the forward (logits and loss included)
    peak: int  # most bytes alive at once over forward and backward, this rank's gradients included


def recomputed_by_compile(cfg: JobConfig) -> frozenset:
    """The ops whose outputs a compiled step does not keep (the module docstring)."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    softmax = (
        {
            aten._log_softmax,
            aten._softmax,
            aten._log_softmax_backward_data,
            aten._softmax_backward_data,
            aten.nll_loss_backward,
        }
        if cfg.compile.compiles("loss")
        else set()
    )
    return frozenset(get_default_op_list().recomputable_ops) | softmax


def planned_shard(seq_len: int, cp: int) -> SequenceShard:
    """cp rank 0's SequenceShard of parallel/cp.py, whose gather makes the all-gather's [B, heads, T, D]
    from cp copies of the rank's own keys or values, with no process group (the module docstring)."""
    return shard_of(seq_len, cp, 0, lambda x: torch.cat([x] * cp, dim=2))


def leave_out_dense_masks(model, tally: LiveBytes) -> None:
    """Under context parallelism the tally counts no attention mask: each block's GatheredKeys carries
    the CPU's dense [T_local, T] one, where a GPU's BlockMask is a few kilobytes."""

    def leave_out(_, inputs):
        for value in inputs:
            if isinstance(value, GatheredKeys):
                tally.ignore(value.mask)

    for block in model.layers.values():
        block.register_forward_pre_hook(leave_out)


def count_sequence_gathers(model, tally: LiveBytes) -> None:
    """Under TP each block's attention and feed-forward take the whole sequence, all-gathered from the
    sequence shards, and return a partial sum of the whole sequence that a reduce-scatter splits
    (parallel/tp.py); in backward the gradient of each output is gathered whole and that of each input
    is whole until reduce-scattered; the output projection takes the final norm's output gathered. The
    tally divides every other tensor by tp: these it counts whole on every rank."""

    def whole(tensor: torch.Tensor) -> None:
        tally.unsplit(tensor)
        if tensor.requires_grad:
            tensor.register_hook(tally.unsplit)

    def whole_output(_, inputs, output):
        whole(output[0] if isinstance(output, tuple) else output)  # an MoE block's hidden state, its loss and loads

    for block in model.layers.values():
        for part in (block.attention, block.feed_forward):
            part.register_forward_pre_hook(lambda _, inputs: whole(inputs[0]))
            part.register_forward_hook(whole_output)
    if model.output is not None:  # a pipeline stage before the last has none
        model.output.register_forward_pre_hook(lambda _, inputs: whole(inputs[0]))


TALLIES: dict[
    tuple, Activations
] = {}  # measure()'s results in this process: a table of rows repeats many jobs' tallies


def measure(
    cfg: JobConfig, spec, args, dims: ParallelDims, n_layers: int, compiled: bool = False, middle: bool = False
) -> Activations:
    """One training micro-step of the model cut to n_layers blocks, tallied op by op (as a compiled
    step keeps it where `compiled`); `middle`: as a pipeline stage holding those blocks alone, which takes
    hidden states and a gradient for its output. Jobs that differ only in what the tally does not read
    (float8, async TP, the node count beyond the shards) share one tally."""
    key = tuple(
        map(
            repr,
            (
                cfg.training,
                cfg.lora,
                cfg.activation_checkpoint,
                cfg.compile,
                spec.model_cls,
                args,
                dims,
                n_layers,
                compiled,
                middle,
            ),
        )
    )
    if key not in TALLIES:
        TALLIES[key] = tally_step(cfg, spec, args, dims, n_layers, compiled, middle)
    return TALLIES[key]


def tally_step(
    cfg: JobConfig, spec, args, dims: ParallelDims, n_layers: int, compiled: bool, middle: bool
) -> Activations:
    """measure() without its memo."""
    training = cfg.training
    compute = DTYPES[training.mixed_precision_param]
    loss_fn = build_loss(training, Compile())  # eager: compile's fused loss keeps fewer temporaries, never more
    fake = FakeTensorMode()  # also active during the step: factory calls in forward (masks, positions) stay fake
    with fake:
        model = spec.model_cls(dataclasses.replace(args, n_layers=n_layers))
        if middle:
            cut_to_stage(model, range(n_layers), first=False, last=False)
        apply_lora(
            model, cfg.lora, whole=False
        )  # a frozen weight's input is not saved for its (never computed) gradient
        route_evenly(model)  # fake tensors hold no router values: each expert takes an equal share (plan/moe.py)
        # FSDP gathers the parameters in the compute dtype; without it autocast casts them, as in train_step.
        dtype = compute if dims.fsdp_enabled else DTYPES[training.param_dtype]
        for param in model.parameters():
            param.data = param.data.to(dtype)
        apply_ac(model, cfg.activation_checkpoint)
        tokens = torch.randint(0, args.vocab_size, (training.local_batch_size, training.seq_len))
        shard = planned_shard(training.seq_len, dims.cp) if dims.cp_enabled else None
        inputs, labels, model_kwargs = split_batch(tokens, tokens, None, shard)  # the train step's split
        if middle:  # the previous stage's hidden states
            inputs = torch.randn(*inputs.shape, args.dim, dtype=dtype, requires_grad=True)
    positions = [shard.positions, shard.key_positions] if shard is not None else []
    tally = LiveBytes(
        dims.tp,
        [*model.parameters(), *model.buffers(), inputs, labels, *positions],
        recomputed_by_compile(cfg) if compiled else frozenset(),
    )
    if shard is not None:
        leave_out_dense_masks(model, tally)
    if dims.tp_enabled:
        count_sequence_gathers(model, tally)
    if compiled:  # what crosses a compiled region's edge is kept: blocks' inputs, the gradients flowing back into each

        def keep_gradient(_, inputs, output):
            output = (
                output[0] if isinstance(output, tuple) else output
            )  # an MoE block's hidden state, its loss and loads
            if output.requires_grad:
                output.register_hook(tally.keep)

        for block in model.layers.values():
            block.register_forward_pre_hook(lambda _, inputs: tally.keep(inputs[0]))
            block.register_forward_hook(keep_gradient)
        model.register_forward_hook(keep_gradient)  # the logits' gradient, the compiled loss's backward output
    fsdp_shards = dims.dp_shard * dims.cp * dims.tp  # FSDP shards over (dp_shard, cp), TP splits each shard
    if dims.fsdp_enabled:
        param_bytes = DTYPES[training.param_dtype].itemsize

        def keep_shard(param):
            tally.forget(param.grad)
            tally.grads += param.numel() * param_bytes // fsdp_shards

        for param in model.parameters():
            if param.requires_grad:  # LoRA's frozen base has no gradient
                param.register_post_accumulate_grad_hook(keep_shard)
    with fake, tally:
        context = mixed_precision_context(dims, training.mixed_precision_param, "cpu")
        if middle:
            with context:
                hidden = model(inputs, **model_kwargs)
            saved = tally.purge()
            hidden.backward(torch.ones_like(hidden))  # the gradient the next stage sends back
        else:
            loss, extra = micro_batch_loss(model, inputs, labels, model_kwargs, loss_fn, context)
            saved = tally.purge()
            # DeepSeek-V3's MTP depths, whose backward train_step runs too (the balance loss adds no activations)
            (loss + extra["mtp"] if "mtp" in extra else loss).backward()
    return Activations(saved // dims.tp, tally.peak)


def ac_period(ac) -> int:
    """Blocks per repeat of the AC pattern: N for every N-th block, else 1."""
    return (every_nth(ac.selective_ac_option) or 1) if ac.mode == "selective" else 1


def middle_stage_transient(cfg: JobConfig, spec, args, dims: ParallelDims, compiled: bool = False) -> int:
    """What a pipeline stage without the embedding and the loss holds above what it saves at its backward's
    peak: one AC period's blocks recomputed and their gradients, whatever its depth. per_block_and_ends puts
    this in its ends (with the loss's, whichever is larger), which only the last stage holds."""
    stage = measure(cfg, spec, args, dims, ac_period(cfg.activation_checkpoint), compiled, middle=True)
    return stage.peak - stage.saved


def per_block_and_ends(
    cfg: JobConfig, spec, args, dims: ParallelDims, compiled: bool = False
) -> tuple[Activations, Activations]:
    """measure() at depths p and 2p (p = the AC period): one block's share, and the rest (the embedding,
    final norm, logits and loss, and the first measured depth's AC remainder)."""
    period = ac_period(cfg.activation_checkpoint)
    low, high = measure(cfg, spec, args, dims, period, compiled), measure(cfg, spec, args, dims, 2 * period, compiled)
    block = Activations((high.saved - low.saved) / period, (high.peak - low.peak) / period)
    return block, Activations(low.saved - period * block.saved, low.peak - period * block.peak)


def activations(cfg: JobConfig, spec, args, dims: ParallelDims, compiled: bool = False) -> Activations:
    """measure() at the model's depth, or per_block_and_ends() extrapolated to it."""
    if args.n_layers <= FULL_DEPTH_UP_TO:
        return measure(cfg, spec, args, dims, args.n_layers, compiled)
    block, ends = per_block_and_ends(cfg, spec, args, dims, compiled)
    return Activations(int(ends.saved + args.n_layers * block.saved), int(ends.peak + args.n_layers * block.peak))
