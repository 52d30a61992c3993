"""Fewest trees at nearly the same rate: Blink's integer program over a packing's trees.

Binary z_i says tree i is kept, x_i is its weight (GB/s): minimise sum z_i subject to the link
capacities, sum x_i >= (1 - eps) * rate, and x_i <= u_i * z_i with u_i tree i's bottleneck on its
own. scipy.optimize.milp (HiGHS) solves it; the kept trees are then re-weighted by the LP for
the highest rate they reach together.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .plan import TreePlan
from .treegen import max_rate_lp


def minimize_trees(plan: TreePlan, eps: float | None = None, *,
                   time_limit_s: float = 30.0) -> TreePlan:
    """A plan using as few of `plan`'s trees as possible at rate >= (1 - eps) * plan.rate.

    `eps` defaults to the plan's own. If HiGHS finds no solution within `time_limit_s`
    seconds, `plan` comes back unchanged (it is always a feasible answer)."""
    if not isinstance(plan, TreePlan):
        raise TypeError(f"minimize_trees needs a TreePlan, got {type(plan).__name__}")
    eps = plan.eps if eps is None else eps
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    k = len(plan.trees)
    if k <= 1:
        return plan
    fabric = plan.fabric
    use = np.stack([fabric.use_vector(fabric.route_index(keys) for keys in routes)
                    for routes in plan.routes], axis=1)
    cap = fabric.capacity
    alone = np.array([min(cap[r] / use[r, i] for r in np.flatnonzero(use[:, i]))
                      for i in range(k)])
    # Aim a hair under the target so round-off in the plan's own weights keeps it feasible.
    target = (1.0 - eps) * plan.rate * (1.0 - 1e-9)
    constraints = [
        LinearConstraint(np.hstack([use, np.zeros_like(use)]), -np.inf, cap),
        LinearConstraint(np.hstack([np.ones(k), np.zeros(k)])[None, :], target, np.inf),
        LinearConstraint(np.hstack([np.eye(k), -np.diag(alone)]), -np.inf, 0.0),
    ]
    res = milp(
        c=np.hstack([np.zeros(k), np.ones(k)]),
        constraints=constraints,
        integrality=np.hstack([np.zeros(k), np.ones(k)]),
        bounds=Bounds(np.zeros(2 * k), np.hstack([alone, np.ones(k)])),
        options={"time_limit": time_limit_s},
    )
    if res.x is None:
        return plan
    keep = [i for i in range(k) if res.x[k + i] > 0.5]
    weights, _ = max_rate_lp(use[:, keep], cap)
    order = sorted(range(len(keep)), key=lambda j: -weights[j])
    trees = [(plan.trees[keep[j]][0], float(weights[j])) for j in order if weights[j] > 0]
    routes = [plan.routes[keep[j]] for j in order if weights[j] > 0]
    return plan.with_trees(trees, routes)
