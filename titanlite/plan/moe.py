"""The planner's mixture of experts: tokens spread evenly over the experts.

How many tokens each expert gets depends on the router's values, which a forward on fake tensors
does not have (the loop over experts splits the sorted tokens by those counts, on the host). The
planner routes as a balanced step does, the state the balance loss or bias steers the router to:
each expert takes an equal share of the batch's N * top_k assignments, so the matmuls and the
tensors they save are those of a balanced step. A skewed router keeps more on its busiest
experts' ranks under expert parallelism, which this does not foresee.

Expert parallelism (parallel/ep.py) leaves each rank E / ep whole experts, FSDP-sharded over the
dp_shard / ep ranks holding the same ones: a rank's share of the state is the same as without EP
(1 / dp_shard of every weight), but FSDP gathers only its E / ep experts of each block. Under even
routing a rank receives as many assignments as it sends, so its experts' activations are those of
the tally (which runs every expert on its share); the two all-to-alls per MoE layer are in the
step time (plan/speed.py).
"""

import functools

from titanlite.parallel.ep import EXPERT_WEIGHTS, is_moe


class BalancedCounts:
    """Stands in for the tokens per expert where the expert loop reads them (tolist)."""

    def __init__(self, assignments: int, num_experts: int):
        share, rest = divmod(assignments, num_experts)
        self.shares = [share + (1 if e < rest else 0) for e in range(num_experts)]

    def tolist(self) -> list[int]:
        return self.shares


def route_evenly(model) -> None:
    """Make every MoE layer of the (fake) model run its experts on balanced counts."""
    for module in model.modules():
        if is_moe(module):
            module.run_experts = functools.partial(balanced_run_experts, module, type(module).run_experts)


def balanced_run_experts(module, run_experts, x, weights, experts, counts):
    return run_experts(module, x, weights, experts, BalancedCounts(experts.numel(), module.num_experts))


def moe_modules(model) -> list:
    return [module for module in model.modules() if is_moe(module)]


def expert_params(model) -> int:
    """Parameters of the routed experts (what expert parallelism splits)."""
    return sum(getattr(module, name).numel() for module in moe_modules(model) for name in EXPERT_WEIGHTS)


def gathered_params(module, ep: int, trained_only: bool = False) -> int:
    """Parameters of `module` that FSDP gathers on one rank: under EP only its E / ep routed experts
    (`trained_only`: those with a gradient, LoRA's frozen base left out)."""
    experts = {id(getattr(moe, name)) for moe in moe_modules(module) for name in EXPERT_WEIGHTS}
    return sum(
        p.numel() // (ep if id(p) in experts else 1) for p in module.parameters() if p.requires_grad or not trained_only
    )
