"""The sparse feed-forward shared by the MoE families (Mixtral, Qwen3 MoE): a router sends each
token to its top-k SwiGLU experts. The families differ in the router, picked by name from ROUTERS.

The experts' weights are stacked (each expert's block of rows laid out like Llama's nn.Linear),
so the expert compute is one grouped matmul per projection over tokens sorted by expert. They are
stored 2-D, [experts * out, in], rather than [experts, out, in]: FSDP shards dim 0, and 8 experts
over more than 8 ranks would leave most ranks holding padding as large as a whole expert.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titanlite.models.init import trunc_normal_
from titanlite.models.llama.model import BASE_INIT_STD, FeedForward
from titanlite.parallel.cp import sum_over_ranks
from titanlite.parallel.ep import all_to_all, exchange_counts, expert_weights


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, experts), each [..., top_k]: the top_k experts by router logit, weighted by
    a softmax over just their logits (Mixtral's rule; equal to a softmax over all experts
    renormalised over the chosen ones, so norm_topk_prob does not apply)."""
    top_logits, experts = logits.topk(top_k, dim=-1)
    return top_logits.float().softmax(dim=-1), experts


def softmax_then_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 MoE's rule: a softmax over all experts, the top_k probabilities as weights, renormalised
    to sum to 1 where norm_topk_prob (else they keep their share of the full softmax)."""
    weights, experts = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


# Router name (the MoE constructor's `router`) -> (logits [..., E], top_k, norm_topk_prob) -> (weights, experts).
ROUTERS = {"softmax_topk": softmax_topk, "softmax_then_topk": softmax_then_topk}


def assignments_per_sequence(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts [B, T, k] (the chosen ones) -> [B, E]: how many of each sequence's T * k
    token-to-expert assignments went to each expert (scatter_add: a fixed shape compiles)."""
    flat = experts.flatten(1)
    return flat.new_zeros(flat.shape[0], num_experts).scatter_add_(1, flat, torch.ones_like(flat))


def load_balancing_loss(
    logits: torch.Tensor, assignments: torch.Tensor, probs: torch.Tensor | None = None, sequence_mesh=None
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, num_experts * sum_i f_i * P_i, per sequence, averaged.

    logits [B, T, E] are the router's, assignments [B, E] from assignments_per_sequence. f_i is expert i's share
    of the sequence's T * k token-to-expert assignments and P_i its mean router probability (a
    softmax over all experts); both are 1/E when balanced, which gives 1.0 (Hugging Face's Mixtral
    loss is top_k times this). The gradient flows through P only: f is a count. Per sequence, as
    DeepSeek-V3 and torchtitan do, so a batch's loss does not depend on how it is split over
    ranks and micro-steps. `probs` [B, T, E] replaces the softmax where a router scores otherwise
    (SigmoidGroupMoE's normalised sigmoids: DeepSeek-V3's sequence-wise balance loss).
    Under context parallelism (`sequence_mesh`, the cp ranks) each rank holds an equal share of every
    sequence: the shares' counts are summed and their mean probabilities averaged, so every cp rank
    computes the whole sequences' loss, as one process does.
    """
    probs = (logits.float().softmax(dim=-1) if probs is None else probs).mean(dim=1)  # [B, E]
    if sequence_mesh is not None:
        probs = sum_over_ranks(probs, sequence_mesh) / sequence_mesh.size()
        assignments = sum_over_ranks(assignments, sequence_mesh)
    shares = assignments.float() / assignments.sum(dim=-1, keepdim=True)
    return assignments.shape[-1] * (shares * probs).sum(dim=-1).mean()


def _looped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    """One matmul per expert over its slice of the sorted tokens (any device and dtype)."""
    slices = x.split(counts.tolist())  # a host sync, which the grouped path avoids
    return torch.cat(
        [F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]) for e, xe in enumerate(slices)]
    )


def _grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    """The same in three grouped GEMMs, one kernel each (torch._grouped_mm: bf16, Hopper or newer)."""
    offsets = counts.cumsum(0, dtype=torch.int32)  # where each expert's rows end

    def matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

    return matmul(F.silu(matmul(x, w1)) * matmul(x, w3), w2)


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def experts_forward(x, weights, experts, counts, w1, w2, w3, grouped: bool | None = None) -> torch.Tensor:
    """sum_j weights[:, j] * SwiGLU_{experts[:, j]}(x), expert by expert rather than token by token.

    x [N, D]; weights, experts [N, k]; counts [E] tokens per expert; w1, w3 [E, H, D]; w2 [E, D, H].
    The N * k (token, expert) assignments are sorted by expert, so each expert's tokens are one
    contiguous block; grouped=None picks the grouped GEMM where it runs, else a loop over experts
    (the one place that chooses).
    """
    order = experts.flatten().argsort(stable=True)
    sorted_x = x[order // experts.shape[1]]  # assignment a belongs to token a // top_k
    grouped = _grouped_mm_supported(sorted_x) if grouped is None else grouped
    out = (_grouped_swiglu if grouped else _looped_swiglu)(sorted_x, counts, w1, w2, w3)
    return weighted_sum(out, order, weights)


def weighted_sum(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [N * k, D], the expert outputs of the assignments sorted by `order` -> [N, D], each token's
    outputs weighted by its routing weights [N, k] and summed."""
    num_tokens, top_k = weights.shape
    out = (
        torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, out.shape[-1])
    )  # (token, slot) order; N may be 0
    return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


# Run eagerly even inside a compiled block: the all-to-all splits are read on the host (.tolist())
# and change every step, so dynamo, tracing them, would specialise on each step's numbers and
# recompile; disabled, the dispatch is a graph break between the block's compiled parts.
@torch.compiler.disable
def experts_forward_over_ranks(x, weights, experts, counts, w1, w2, w3, group) -> torch.Tensor:
    """experts_forward with the experts split over the ranks of `group` (expert parallelism: w1, w2, w3
    hold this rank's E / ep experts): each assignment goes to its expert's rank and its output comes
    back, by two all-to-alls; the routing weights are applied here, on the token's own rank."""
    order = experts.flatten().argsort(stable=True)
    ep = dist.get_world_size(group)
    received = exchange_counts(counts, group)  # [ep, E / ep]: from each rank, per local expert
    send, receive = counts.view(ep, -1).sum(dim=1).tolist(), received.sum(dim=1).tolist()
    tokens = all_to_all(x[order // experts.shape[1]], receive, send, group)
    per_rank = received.shape[1]  # the received rows: source rank, then local expert
    local_experts = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    out = experts_forward(
        tokens, tokens.new_ones(tokens.shape[0], 1), local_experts[:, None], received.sum(dim=0), w1, w2, w3
    )
    return weighted_sum(all_to_all(out, send, receive, group), order, weights)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts in place of Llama's FeedForward (same init_weights); `router` names
    the routing rule in ROUTERS.

    forward returns (output, load-balancing loss, tokens per expert): the router's numbers leave
    as outputs, not as attributes set on the way, because activation checkpointing and fullgraph
    compile of a block forbid such side effects.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        router: str = "softmax_topk",
        norm_topk_prob: bool = True,
    ):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router '{router}' is not one of {', '.join(ROUTERS)}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router, self.norm_topk_prob = router, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)  # the router
        self.w1 = nn.Parameter(torch.empty(num_experts * hidden_dim, dim))  # viewed as [E, H, D]
        self.w2 = nn.Parameter(torch.empty(num_experts * dim, hidden_dim))  # viewed as [E, D, H]
        self.w3 = nn.Parameter(torch.empty(num_experts * hidden_dim, dim))  # viewed as [E, H, D]
        self.ep_group = None  # the expert-parallel process group, set by titanlite.parallel.ep.apply_ep
        self.sequence_mesh = (
            None  # the cp ranks holding the rest of each sequence, set by titanlite.parallel.cp.apply_cp
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (out [B, T, D], balance loss (0-dim), tokens per expert [E])."""
        batch, seq_len, dim = x.shape
        logits = self.gate(x)  # [B, T, E]
        weights, experts = self.route(logits)
        assignments = assignments_per_sequence(experts, self.num_experts)
        counts = assignments.sum(dim=0)
        out = self.run_experts(
            x.reshape(-1, dim), weights.reshape(-1, self.top_k), experts.reshape(-1, self.top_k), counts
        )
        return out.view(batch, seq_len, dim), self.balance_loss(logits, assignments), counts

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [B, T, top_k], of the router logits [B, T, E]."""
        return ROUTERS[self.router](logits, self.top_k, self.norm_topk_prob)

    def balance_loss(self, logits: torch.Tensor, assignments: torch.Tensor) -> torch.Tensor:
        return load_balancing_loss(logits, assignments, sequence_mesh=self.sequence_mesh)

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x [N, D] through each token's experts, weighted (TP's expert split replaces this method)."""
        if self.ep_group is not None:  # this rank's experts: a DTensor shard on the ep mesh
            w1, w2, w3 = expert_weights([self.w1, self.w2, self.w3], self.ep_group)
            w1, w2, w3 = (
                w.view(self.num_experts // dist.get_world_size(self.ep_group), -1, w.shape[-1]) for w in (w1, w2, w3)
            )
            return experts_forward_over_ranks(x, weights, experts, counts, w1, w2, w3, self.ep_group)
        w1, w2, w3 = (w.view(self.num_experts, -1, w.shape[-1]) for w in (self.w1, self.w2, self.w3))
        return experts_forward(x, weights, experts, counts, w1, w2, w3)

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        """As Llama's FeedForward: w1 (and the router) at the base std, w2 and w3 depth-scaled."""
        trunc_normal_(self.gate.weight, BASE_INIT_STD, key=f"{prefix}gate.weight", seed=seed)
        trunc_normal_(self.w1, BASE_INIT_STD, key=f"{prefix}w1", seed=seed)
        for name in ("w2", "w3"):
            trunc_normal_(getattr(self, name), out_std, key=f"{prefix}{name}", seed=seed)


# DeepSeek-V3's router (also Moonlight's and Kimi K2's).


def sigmoid_group_topk(
    logits: torch.Tensor, top_k: int, bias: torch.Tensor, n_group: int, topk_group: int, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's rule ("noaux_tc"): sigmoid scores; the experts are chosen by score + `bias` (the
    aux-loss-free balancing bias, which only steers the choice), among the topk_group of the n_group
    groups whose two best biased scores sum highest; the weights are the chosen experts' unbiased
    scores, renormalised to sum to 1 where norm_topk_prob (the 1e-20 as in DeepSeek's code)."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    if n_group > 1:
        grouped = choice.unflatten(-1, (n_group, -1))  # [..., groups, experts per group]
        best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=logits.device).scatter_(-1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, experts


class SigmoidGroupMoE(MoE):
    """The routed experts with sigmoid_group_topk routing, the weights times routed_scaling_factor, and
    `shared_hidden_dim` of shared experts (one SwiGLU every token goes through; 0 = none) added.

    `expert_bias` [E] (float32, saved with the model, no gradient) is the aux-loss-free balancing
    bias: the trainer moves it after each optimizer step (balance_experts); the balance loss, an
    option (model.moe_aux_loss_coeff), is DeepSeek-V3's sequence-wise one over normalised sigmoids.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_hidden_dim: int = 0,
        norm_topk_prob: bool = True,
    ):
        super().__init__(dim, hidden_dim, num_experts, top_k, norm_topk_prob=norm_topk_prob)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.shared_experts = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = sigmoid_group_topk(
            logits, self.top_k, self.expert_bias, self.n_group, self.topk_group, self.norm_topk_prob
        )
        return weights * self.routed_scaling_factor, experts

    def balance_loss(self, logits: torch.Tensor, assignments: torch.Tensor) -> torch.Tensor:
        scores = logits.float().sigmoid()
        return load_balancing_loss(
            logits, assignments, probs=scores / scores.sum(dim=-1, keepdim=True), sequence_mesh=self.sequence_mesh
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, aux_loss, counts = super().forward(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, aux_loss, counts

    @torch.no_grad()
    def balance_experts(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing (arXiv 2412.19437, section 2.1.2): each expert's bias
        rises by `rate` if it got fewer than the mean of the step's tokens, falls by `rate` if more."""
        mean = tokens_per_expert.double().mean()
        self.expert_bias += rate * torch.sign(mean - tokens_per_expert.double()).float()

    def init_weights(self, prefix: str, seed: int, out_std: float) -> None:
        super().init_weights(prefix, seed, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(f"{prefix}shared_experts.", seed, out_std)
        # Recreated in float32: the trainer may have cast the model to bf16, too coarse for small steps.
        self.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=self.expert_bias.device)
