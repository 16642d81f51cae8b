"""The Llama decoder: RoPE, grouped-query attention, SwiGLU feed-forward, pre-norm blocks.

Parameter names follow Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...), so the
FQNs are stable for checkpoints and for the blocks other families build from these modules.
Nothing here knows about parallelism; `parallelize(model, dims, cfg)` is applied from outside.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.errors import UserError
from titanlite.models.attention import Mask, attend, attention_mask, document_positions, for_layer
from titanlite.models.init import trunc_normal_
from titanlite.models.kv_cache import CacheStep
from titanlite.models.llama.args import ModelArgs, RopeScaling
from titanlite.parallel.cp import SequenceShard

# Std of the input-side projections; output-side ones are scaled down with depth (below).
BASE_INIT_STD = 0.02


def _scale_rope_freqs(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling, applied per frequency by its wavelength."""
    wavelen = 2 * torch.pi / freqs
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, each [max_seq_len, head_dim // 2], float32.

    Real tables rather than complex ones: complex buffers trip up dtype casts, DTensor and compile.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        freqs = _scale_rope_freqs(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, head_dim] by position; cos/sin are [T, head_dim // 2], or [B, T, head_dim // 2]
    where positions differ between sequences (model.reset_position_ids).

    Pairs are adjacent elements (x[2i], x[2i+1]) as in Meta's checkpoints (Hugging Face permutes
    wq/wk to use split halves instead). Computed in float32 so long positions stay accurate.
    """
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Multi-head attention with `n_kv_heads` key/value heads shared by groups of query heads, under
    the mask the model built for this forward (causal, documents, Mistral's window: models/attention.py)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int | None = None):
        """head_dim defaults to dim // n_heads; Qwen3 sets its own."""
        super().__init__()
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask) -> torch.Tensor:
        """rope_cos/rope_sin: the tables of at least seq_len positions, [T', head_dim // 2] or per token
        [B, T, head_dim // 2] (a pipeline stage after the first sees only sequence shards between its
        blocks, so the whole sequence is known only here)."""
        batch, seq_len, _ = x.shape
        rope_cos, rope_sin = rope_cos[..., :seq_len, :], rope_sin[..., :seq_len, :]
        # Head counts come from the weights (-1), so a tensor-parallel shard with fewer local heads works as is.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = self.normalize_heads(q, k)
        q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]; attend repeats k, v for GQA
        out = attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def normalize_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Llama has no per-head norm before RoPE; Qwen3 overrides this."""
        return q, k

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        for name in ("wq", "wk", "wv"):
            trunc_normal_(getattr(self, name).weight, BASE_INIT_STD, key=f"{prefix}{name}.weight", seed=seed)
        trunc_normal_(self.wo.weight, out_std, key=f"{prefix}wo.weight", seed=seed)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        trunc_normal_(self.w1.weight, BASE_INIT_STD, key=f"{prefix}w1.weight", seed=seed)
        for name in ("w2", "w3"):
            trunc_normal_(getattr(self, name).weight, out_std, key=f"{prefix}{name}.weight", seed=seed)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    Self-contained (the RoPE tables and the attention mask come in as arguments) so FSDP, activation
    checkpointing and torch.compile can each wrap one block.
    """

    def __init__(
        self, layer_id: int, args: ModelArgs, attention: nn.Module | None = None, feed_forward: nn.Module | None = None
    ):
        """`attention` and `feed_forward` default to Llama's; families built on this block pass their
        own (Mixtral's experts), with the same init_weights."""
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention if attention is not None else Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled std for the projections that write into the residual stream, so deeper
        # layers start with smaller updates.
        self.out_init_std = BASE_INIT_STD / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, prefix: str, seed: int) -> None:
        """`prefix` is the block's FQN ("layers.3."): init keys must not depend on wrappers."""
        nn.init.ones_(self.attention_norm.weight)
        nn.init.ones_(self.ffn_norm.weight)
        self.attention.init_weights(f"{prefix}attention.", seed, self.out_init_std)
        self.feed_forward.init_weights(f"{prefix}feed_forward.", seed, self.out_init_std)


def check_seq_len(tokens: torch.Tensor, max_seq_len: int, shard: SequenceShard | None = None) -> None:
    """Refuse a [B, T] batch whose windows (under context parallelism the whole window, not the shard) are
    longer than the model has positions for."""
    seq_len = tokens.shape[1] if shard is None else shard.seq_len
    if seq_len > max_seq_len:
        raise UserError(
            f"sequences of {seq_len} tokens are longer than this model's max_seq_len "
            f"{max_seq_len}; set training.seq_len to at most {max_seq_len}"
        )


def token_positions(document_ids: torch.Tensor | None, shard: SequenceShard | None) -> torch.Tensor | None:
    """Each token's position where it is not its index in the window: counted from its document's first
    token where `document_ids` are given (model.reset_position_ids; [B, T]), and under context parallelism
    only this rank's tokens ([B, T_local], or [T_local] without documents). None = 0..T-1."""
    positions = None if document_ids is None else document_positions(document_ids)
    if shard is None:
        return positions
    return shard.positions if positions is None else shard.take(positions)


class KeepsTiedEmbeddings(nn.Module):
    """Base of the decoders: their output head (the final norm and output projection), which may be
    their token embedding (`args.tie_embeddings`)."""

    def head(self, h: torch.Tensor, output_loss=None) -> torch.Tensor:
        """The final norm, then the logits [B, T, vocab] in the compute dtype, or, given `output_loss`
        (titanlite/loss.py: (hidden states [N, D], output weight) -> loss), that loss, which need not
        hold the logits. It runs inside the model's forward, where FSDP has gathered the weights; a tied
        output weight is the embedding's, so it gets both gradients."""
        h = self.norm(h)
        if output_loss is None:
            return self.output(h)
        return output_loss(h.flatten(0, 1), self.output.weight)

    def _apply(self, fn, recurse=True):
        # Module.to_empty / .to may replace each module's Parameter separately, which would split
        # a tied matrix in two; point the output back at the embedding.
        super()._apply(fn, recurse)
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        return self


class Transformer(KeepsTiedEmbeddings):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from args, so not saved in checkpoints; init_weights recomputes them.
        rope_cos, rope_sin = self._rope_tables(device=None)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def build_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        """One decoder block; families reusing this decoder (Mistral, Mixtral) override it."""
        return TransformerBlock(layer_id, args)

    def _rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        output_loss=None,
        sequence_shard: SequenceShard | None = None,
        cache: CacheStep | None = None,
        extra_losses: bool = False,
    ):
        """tokens [B, T] -> logits [B, T, vocab] in the compute dtype, or the loss where `output_loss` is
        given (head()). With a `cache` step (generation, models/kv_cache.py) the tokens follow the cached
        ones at its positions, and only the last position's logits [B, 1, vocab] are computed. With `document_ids` [B,
        T]
        (models/attention.py) each token attends only within its document, and with
        args.reset_position_ids its RoPE position counts from its document's first token.
        Under context parallelism `sequence_shard` says which positions of the window `tokens` are
        (document_ids stay the whole window's).

        A pipeline stage lacks the modules of the other stages (None): a stage after the first takes
        the previous stage's hidden states as `tokens`, one before the last returns its hidden states.

        With `extra_losses` it returns (that output, {name: loss}): the losses a family adds to the training
        objective (extra_loss_names below), {} where it has none.
        """
        if cache is not None:
            h, _ = self.run_blocks(
                self.tok_embeddings(tokens), self.rope_cos[cache.positions], self.rope_sin[cache.positions], cache
            )
            return self.head(h[:, -1:])
        h = tokens
        if self.tok_embeddings is not None:
            check_seq_len(tokens, self.args.max_seq_len, sequence_shard)
            h = self.tok_embeddings(tokens)
        rope_cos, rope_sin = self.rope_cos, self.rope_sin  # each Attention takes the positions it sees
        positions = token_positions(document_ids if self.args.reset_position_ids else None, sequence_shard)
        if positions is not None:
            rope_cos, rope_sin = self.rope_cos[positions], self.rope_sin[positions]  # [B or none, T, head_dim // 2]
        # Built once here and shared by every block; Mistral and Mixtral args carry a sliding window.
        mask = attention_mask(document_ids, getattr(self.args, "sliding_window", None), tokens.device, sequence_shard)
        h, losses = self.run_blocks(h, rope_cos, rope_sin, mask)
        out = h if self.output is None else self.head(h, output_loss)
        return (out, losses) if extra_losses else out

    def run_blocks(
        self, h: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The blocks in order -> (h, the family's extra losses); families whose blocks return more than h (Mixtral)
        override it."""
        for name, block in self.layers.items():
            h = block(h, rope_cos, rope_sin, for_layer(mask, name))
        return h, {}

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter and buffer in place, identically for any sharding."""
        self.rope_cos, self.rope_sin = self._rope_tables(device=self.rope_cos.device)
        # Output std dim**-0.5 gives unit-scale logits at the start.
        out_std = self.args.dim**-0.5
        if self.args.tie_embeddings:
            # One matrix, two jobs: init it for its output role (the first RMSNorm rescales its
            # embedding role anyway). A pipeline's first and last stages each hold a copy, drawn alike.
            tied = self.tok_embeddings if self.tok_embeddings is not None else self.output
            if tied is not None:
                trunc_normal_(tied.weight, out_std, key="tok_embeddings.weight", seed=seed)
        else:  # a pipeline stage holds either, both or neither (None)
            # Std 1.0 as in torchtitan: each block's input is RMS-normalised, so the scale only makes
            # the embedding dominate the residual stream early on, which keeps the start stable.
            if self.tok_embeddings is not None:
                trunc_normal_(self.tok_embeddings.weight, 1.0, key="tok_embeddings.weight", seed=seed)
            if self.output is not None:
                trunc_normal_(self.output.weight, out_std, key="output.weight", seed=seed)
        for layer_id, block in self.layers.items():
            block.init_weights(f"layers.{layer_id}.", seed)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (a tied matrix counts once); works on meta and sharded models.

        exclude_embedding drops the token embedding table, which does a lookup rather than a
        matmul; when tied, that same matrix is also the output projection (a matmul), so it stays.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.args.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total
