"""The exact allocator: a MILP over contiguous stages solved by HiGHS (`scipy.optimize.milp`).

Variables: binaries u[d, l] = 1 when layer l sits on one of devices 0..d (for d < D - 1; the
last device closes every layer), and the bottleneck time z. Then x[d, l] = u[d, l] - u[d-1, l]
says layer l is on device d, and e[d, l] = u[d, l] - u[d, l+1] says stage d ends at layer l,
which prices the stage's link transfer. Constraints, all linear:

- u non-increasing along layers and non-decreasing along devices (stages are contiguous and in
  pipeline order);
- every stage holds at least one layer and fits its device's memory;
- z >= compute(d) + link(d) for every stage d;
- z <= the sky plan's bottleneck (a hair above it): the heuristic's answer is the incumbent to
  beat. The anchor warm-starts its MILP with the even split; `scipy.optimize.milp` takes no
  starting solution, so the bound plays that part and every split HiGHS finds is at least as
  good as sky's (and so as even's). With that bound each boundary can only lie where stages
  no slower than sky's bottleneck reach from either end, which fixes most u before HiGHS
  starts.

Minimise z. Times are scaled to the largest single layer or link time, and memory rows to the
device's budget, so the coefficients stay near 1 for the solver.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .cost import CostModel
from .plan import Plan
from .sky import allocate_sky


def allocate_optimal(
    cost: CostModel,
    time_limit_s: float = 20.0,
    mip_rel_gap: float = 1e-6,
    clock: Callable[[], float] = time.perf_counter,
) -> Plan:
    """The plan minimising the bottleneck stage time, proved within `mip_rel_gap`.

    HiGHS stops after `time_limit_s` seconds; the plan is then its best split, with status
    "time_limit" and `mip_gap` the relative gap between that split's bottleneck and HiGHS's
    lower bound; or, if HiGHS found no split better than sky's, the sky plan with the gap to
    the LP relaxation's bound (None if even that LP ran out of time). `planning_s` includes
    the sky heuristic and the LP.
    Raises `PlacementInfeasible` when no split fits.
    """
    start = clock()
    sky = allocate_sky(cost, clock)
    num_d, num_l = cost.num_devices, cost.num_layers
    if num_d == 1:
        return cost.plan("optimal", (0, num_l), clock() - start, "optimal", 0.0)
    scale = float(max(cost.layer_s.max(), cost.link_s.max()))
    upper = sky.max_stage_time_s / scale * (1 + 1e-7)
    n_u = (num_d - 1) * num_l
    lo, hi = _boundary_ranges(cost, sky.max_stage_time_s * (1 + 1e-7))
    layer = np.arange(num_l)
    u_lo = np.concatenate([(layer < lo[d]).astype(float) for d in range(1, num_d)])
    u_hi = np.concatenate([(layer < hi[d]).astype(float) for d in range(1, num_d)])
    integrality = np.concatenate([np.ones(n_u), [0]])
    objective = np.concatenate([np.zeros(n_u), [1.0]])
    problem = {
        "c": objective,
        "bounds": Bounds(np.concatenate([u_lo, [0.0]]), np.concatenate([u_hi, [upper]])),
        "constraints": _constraints(cost, scale),
    }
    res = milp(integrality=integrality, **problem,
               options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False})
    if res.status not in (0, 1):
        raise RuntimeError(f"HiGHS failed on a problem the sky plan solves: {res.message}")
    if res.x is None:
        # No split under sky's bottleneck in time, and scipy then reports no dual bound:
        # keep the sky plan, with the gap the LP relaxation proves.
        lp = milp(integrality=np.zeros_like(integrality), **problem,
                  options={"time_limit": time_limit_s, "disp": False})
        gap = None if lp.status != 0 else max(0.0, 1 - lp.fun * scale / sky.max_stage_time_s)
        return cost.plan("optimal", sky.boundaries, clock() - start, "time_limit", gap)
    u = np.round(res.x[:n_u]).reshape(num_d - 1, num_l)
    boundaries = (0, *(int(k) for k in u.sum(axis=1)), num_l)
    status = "optimal" if res.status == 0 else "time_limit"
    return cost.plan("optimal", boundaries, clock() - start, status, float(res.mip_gap))


def _constraints(cost: CostModel, scale: float) -> LinearConstraint:
    """The MILP's rows (see the module docstring), times divided by `scale` seconds."""
    num_d, num_l = cost.num_devices, cost.num_layers
    rows = _Rows(num_d, num_l)
    for d in range(num_d - 1):  # monotone along layers: u[d, l+1] <= u[d, l]
        for lay in range(num_l - 1):
            rows.add({(d, lay + 1): 1.0, (d, lay): -1.0}, hi=0.0)
    for d in range(num_d - 2):  # monotone along devices: u[d, l] <= u[d+1, l]
        for lay in range(num_l):
            rows.add({(d, lay): 1.0, (d + 1, lay): -1.0}, hi=0.0)
    for d in range(num_d):
        on_d: dict[tuple[int, int], float] = {}  # x[d, l] = u[d, l] - u[d-1, l]
        for lay in range(num_l):
            on_d[(d, lay)] = 1.0
            on_d[(d - 1, lay)] = -1.0
        rows.add(on_d, lo=1.0)
        rows.add({k: v * cost.layer_bytes[k[1]] / cost.capacity_bytes[d]
                  for k, v in on_d.items()}, hi=1.0)
        stage = {k: v * cost.layer_s[d, k[1]] / scale for k, v in on_d.items()}
        for lay in range(num_l):  # link cost times e[d, l] = u[d, l] - u[d, l+1]
            c = cost.link_s[d, lay] / scale
            stage[(d, lay)] += c
            if lay + 1 < num_l:
                stage[(d, lay + 1)] -= c
        rows.add(stage, hi=0.0, z=-1.0)
    return rows.constraint()


def _boundary_ranges(cost: CostModel, upper_s: float) -> tuple[list[int], list[int]]:
    """lo[d] <= b_d <= hi[d] for every split whose stages all fit and take at most
    `upper_s` seconds of compute (links only add time, so dropping them keeps the bounds
    valid). From the left, each stage reaching as far as it can bounds how far stage d can
    end; from the right, the same bounds how early it can start."""
    num_d, num_l = cost.num_devices, cost.num_layers
    mem = cost.memory_prefix_bytes
    hi, lo = [0] * (num_d + 1), [num_l] * (num_d + 1)
    for d in range(num_d - 1):
        row, a = cost.compute_prefix_s[d], hi[d]
        by_time = np.searchsorted(row, row[a] + upper_s, side="right") - 1
        by_memory = np.searchsorted(mem, mem[a] + cost.capacity_bytes[d], side="right") - 1
        hi[d + 1] = int(min(by_time, by_memory, num_l - (num_d - 1 - d)))
    hi[num_d] = num_l
    for d in range(num_d - 1, 0, -1):
        row, z = cost.compute_prefix_s[d], lo[d + 1]
        by_time = np.searchsorted(row, row[z] - upper_s, side="left")
        by_memory = np.searchsorted(mem, mem[z] - cost.capacity_bytes[d], side="left")
        lo[d] = int(max(by_time, by_memory, d))
    lo[0] = 0
    return lo, hi


class _Rows:
    """Sparse constraint rows over u[d, l] (d < D - 1) and z; terms on u[-1, l] (always 0) are
    dropped and terms on u[D-1, l] (always 1) move to the row's bounds."""

    def __init__(self, num_d: int, num_l: int) -> None:
        self.num_d, self.num_l = num_d, num_l
        self.cols: list[int] = []
        self.row_of: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: dict[tuple[int, int], float], lo: float = -np.inf,
            hi: float = np.inf, z: float = 0.0) -> None:
        row, const = len(self.lo), 0.0
        for (d, lay), v in terms.items():
            if d == self.num_d - 1:
                const += v
            elif d >= 0 and v != 0.0:
                self.row_of.append(row)
                self.cols.append(d * self.num_l + lay)
                self.vals.append(v)
        if z:
            self.row_of.append(row)
            self.cols.append((self.num_d - 1) * self.num_l)
            self.vals.append(z)
        self.lo.append(lo - const)
        self.hi.append(hi - const)

    def constraint(self) -> LinearConstraint:
        n = (self.num_d - 1) * self.num_l + 1
        matrix = coo_array((self.vals, (self.row_of, self.cols)), shape=(len(self.lo), n))
        return LinearConstraint(matrix.tocsr(), self.lo, self.hi)
