"""The planner's mixture of experts: tokens spread evenly over the experts.

How many tokens each expert gets depends on the router's values, which a forward on fake tensors
does not have (the loop over experts splits the sorted tokens by those counts, on the host). The
planner routes as a balanced step does, the state the balance loss or bias steers the router to:
each expert takes an equal share of the batch's N * top_k assignments, so the matmuls and the
tensors they save are those of a balanced step. A skewed router keeps more on its busiest
experts' ranks under expert parallelism, which this does not foresee.
"""

import functools

from titanlite.parallel.ep import is_moe


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
