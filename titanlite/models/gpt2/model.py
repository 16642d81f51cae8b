"""GPT-2: learned absolute positions, pre-LayerNorm blocks with biases, a 4x GELU MLP, tied embeddings.

The module tree mirrors Llama's (tok_embeddings, layers.N.attention / feed_forward, norm, output)
so the trainer, FSDP and checkpoints treat both alike; the HF adapter maps the names to GPT-2's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.models.attention import Mask, attend, attention_mask
from titanlite.models.gpt2.args import GPT2Args
from titanlite.models.init import trunc_normal_
from titanlite.models.kv_cache import CacheStep
from titanlite.models.llama.model import KeepsTiedEmbeddings, check_seq_len, token_positions
from titanlite.parallel.cp import SequenceShard

# OpenAI's GPT-2 init: weights N(0, 0.02), position embeddings N(0, 0.01), and the projections
# that write into the residual stream scaled by 1/sqrt(2 * layers).
INIT_STD = 0.02
POSITION_INIT_STD = 0.01


class Attention(nn.Module):
    """Multi-head attention with one fused q/k/v projection, as GPT-2's c_attn, under the model's mask."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.wqkv(x).view(batch, seq_len, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        out = attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # GPT-2's GELU is the tanh one


class TransformerBlock(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        """`prefix` is the block's FQN ("layers.3."): init keys must not depend on wrappers."""
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
        stds = {
            "attention.wqkv": INIT_STD,
            "attention.wo": out_std,
            "feed_forward.w1": INIT_STD,
            "feed_forward.w2": out_std,
        }
        for name, std in stds.items():
            linear = self.get_submodule(name)
            trunc_normal_(linear.weight, std, key=f"{prefix}{name}.weight", seed=seed)
            nn.init.zeros_(linear.bias)


class GPT2(KeepsTiedEmbeddings):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied, as in GPT-2

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
        given (KeepsTiedEmbeddings.head). With a `cache` step (generation, models/kv_cache.py) the tokens
        follow the cached ones at its positions, and only the last position's logits [B, 1, vocab] are computed. With
        `document_ids` [B, T]
        (models/attention.py) each token attends only within its document, and with
        args.reset_position_ids its position counts from its document's first token. Under context
        parallelism `sequence_shard` says which positions of the window `tokens` are.

        A pipeline stage lacks the modules of the other stages (None): a stage after the first takes
        the previous stage's hidden states as `tokens`, one before the last returns its hidden states.
        With `extra_losses` it returns (that output, {}), as every family does (GPT-2 adds no loss of its own)."""
        if cache is not None:
            h = self.tok_embeddings(tokens) + self.pos_embeddings(cache.positions)
            for name, block in self.layers.items():
                h = block(h, cache.layer(name))
            return self.head(h[:, -1:])
        h = tokens
        if self.tok_embeddings is not None:
            check_seq_len(tokens, self.args.max_seq_len, sequence_shard)
            positions = token_positions(document_ids if self.args.reset_position_ids else None, sequence_shard)
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        mask = attention_mask(document_ids, None, tokens.device, sequence_shard)  # built once, shared by every block
        for block in self.layers.values():
            h = block(h, mask)
        out = h if self.output is None else self.head(h, output_loss)
        return (out, {}) if extra_losses else out

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter in place, identically for any sharding; a pipeline stage
        holds some of them (the others None), the first and last stages each a copy of the tied matrix."""
        tied = self.tok_embeddings if self.tok_embeddings is not None else self.output
        if tied is not None:
            trunc_normal_(tied.weight, INIT_STD, key="tok_embeddings.weight", seed=seed)
        if self.pos_embeddings is not None:
            trunc_normal_(self.pos_embeddings.weight, POSITION_INIT_STD, key="pos_embeddings.weight", seed=seed)
        out_std = INIT_STD / (2 * self.args.n_layers) ** 0.5
        for layer_id, block in self.layers.items():
            block.init_weights(f"layers.{layer_id}.", seed, out_std)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
            nn.init.zeros_(self.norm.bias)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Unique parameters (the tied matrix counts once); works on meta and sharded models.

        exclude_embedding drops the position table, a lookup; the token matrix stays, as it is also
        the output projection (a matmul).
        """
        total = sum(p.numel() for p in self.parameters())
        return total - self.pos_embeddings.weight.numel() if exclude_embedding else total
