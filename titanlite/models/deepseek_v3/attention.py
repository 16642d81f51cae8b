"""Multi-head latent attention (MLA, DeepSeek-V2, arXiv 2405.04434), written for training.

Queries and keys/values go through low-rank bottlenecks:
    q  = wq_b(q_norm(wq_a(x)))        (or wq(x) when q_lora_rank is 0)   -> per head [nope | rope]
    wkv_a(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]
    [k_nope | v] = wkv_b(kv_norm(latent))                                -> per head
RoPE turns only the rope parts, and the key's rope part is one vector shared by every head
(decoupled RoPE), so the cacheable state is the latent plus k_rope. Each head's key is
[k_nope | k_rope] (qk_head_dim = nope + rope) and its value v_head_dim wide, which may differ.

RoPE pairs are adjacent dimensions, DeepSeek's layout (transformers' rope_interleave): titanlite's
apply_rope. Names are DeepSeek's reference ones (wq_a, wkv_b, ...); hf_adapter.py maps them.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite.models.attention import Mask, attend
from titanlite.models.deepseek_v3.args import DeepSeekV3Args
from titanlite.models.deepseek_v3.rope import softmax_scale
from titanlite.models.init import trunc_normal_
from titanlite.models.kv_cache import LayerStep
from titanlite.models.llama.model import BASE_INIT_STD, apply_rope

LATENT_NORM_EPS = 1e-6  # the q and kv latent norms' eps in DeepSeek's code and transformers, whatever rms_norm_eps says


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_heads_dim = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_heads_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, qk_heads_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = softmax_scale(args)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, mask: Mask) -> torch.Tensor:
        """x [B, T, dim]; rope_cos/rope_sin the tables of at least T positions, [T', rope_dim // 2] or
        per token [B, T, rope_dim // 2]; mask from models/attention.py."""
        batch, seq_len, _ = x.shape
        rope_cos, rope_sin = rope_cos[..., :seq_len, :], rope_sin[..., :seq_len, :]
        # Head counts come from the weights (-1): a tensor-parallel shard holds fewer heads.
        q_nope, q_rope = (
            self.queries(x)
            .view(batch, seq_len, -1, self.nope_dim + self.rope_dim)
            .split([self.nope_dim, self.rope_dim], dim=-1)
        )
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope_cos, rope_sin)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope_cos, rope_sin)  # one head, shared by all
        if isinstance(mask, LayerStep):
            out = self.attend_cached_latent(q_nope, q_rope, self.kv_norm(latent), k_rope.squeeze(2), mask)
            return self.wo(out.reshape(batch, seq_len, -1))
        k_nope, v = (
            self.wkv_b(self.kv_norm(latent))
            .view(batch, seq_len, -1, self.nope_dim + self.v_dim)
            .split([self.nope_dim, self.v_dim], dim=-1)
        )
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def attend_cached_latent(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, step: LayerStep
    ) -> torch.Tensor:
        """Generation's attention over the cache of normalised latents [B, S, rank] and RoPE keys [B, S, rope_dim],
        as DeepSeek's inference absorbs wkv_b: each head's query is taken into the latent space, so the keys and
        values are never expanded per head. q_nope [B, T, heads, nope], q_rope [B, T, heads, rope] ->
        [B, T, heads, v_dim]."""
        latent, k_rope = step.extend(latent, k_rope)
        weight = self.wkv_b.weight  # under tensor parallelism (a DTensor) this rank's heads' rows
        weight = weight.to_local() if isinstance(weight, DTensor) else weight
        w_kv = weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)  # [heads, nope + v, rank]
        q_latent = torch.einsum("bthd,hdc->bhtc", q_nope, w_kv[:, : self.nope_dim])
        # One key/value "head" shared by all query heads: [latent | k_rope] keys, the latent as values.
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)
        k = torch.cat([latent, k_rope], dim=-1)[:, None].expand(-1, q.shape[1], -1, -1)
        v = latent[:, None].expand(-1, q.shape[1], -1, -1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=step.mask, scale=self.softmax_scale
        )  # [B, heads, T, rank]
        return torch.einsum("bhtc,hdc->bthd", out, w_kv[:, self.nope_dim :])

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        """Llama's scheme: input-side projections at the base std, wo depth-scaled; norms at 1."""
        for name, module in self.named_children():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            else:
                std = out_std if name == "wo" else BASE_INIT_STD
                trunc_normal_(module.weight, std, key=f"{prefix}{name}.weight", seed=seed)
