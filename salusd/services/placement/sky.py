"""Sky Computing's two-phase heuristic: memory-proportional pre-allocation, then local moves.

Phase 1 gives each device, in pipeline order, a share of the model's memory in proportion to
its own memory budget (a split that fits, found among the splits that leave the remaining
layers placeable). Phase 2 repeatedly takes the most loaded stage and moves its first layers to
the previous stage or its last layers to the next one (which passes layers further along when
it would become the bottleneck), never over a device's memory; it stops when no move brings
the stages it touches under the maximum.

Phase 2 only ever lowers the bottleneck, but from the memory-proportional start it can stop at
a split worse than the even one: phase 1 ignores speed, so it may leave a heavy layer alone on a
slow device, and a stage of one layer has nothing to shed. So phase 2 also runs from the even
split when that fits, and the better result is returned; the plan is then never worse than
`allocate_even` in the cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from .cost import CostModel
from .even import even_boundaries
from .feasibility import check_feasible
from .plan import Plan


def allocate_sky(cost: CostModel, clock: Callable[[], float] = time.perf_counter) -> Plan:
    """The heuristic plan; raises `PlacementInfeasible` when no split fits the devices."""
    start = clock()
    ok = check_feasible(cost)
    starts = [memory_proportional_boundaries(cost, ok)]
    even = even_boundaries(cost.num_layers, cost.num_devices)
    if all(cost.fits(d, even[d], even[d + 1]) for d in range(cost.num_devices)):
        starts.append(list(even))
    results = [move_boundary_layers(cost, b) for b in starts]
    best = min(results, key=lambda b: max(_times(cost, b)))
    return cost.plan("sky", tuple(best), clock() - start, "heuristic")


def memory_proportional_boundaries(cost: CostModel, ok: npt.NDArray[np.bool_]) -> list[int]:
    """Phase 1: stage d ends where the layers' cumulative memory is nearest to the share of
    devices 0..d in the total memory budget, among ends that fit and keep the rest placeable."""
    prefix = cost.memory_prefix_bytes
    share = np.cumsum(cost.capacity_bytes) / cost.capacity_bytes.sum()
    b = [0]
    for d in range(cost.num_devices - 1):
        a = b[-1]
        hi = int(cost.max_ends(d)[a])
        ends = np.flatnonzero(ok[d + 1, a + 1:hi + 1]) + a + 1
        b.append(int(ends[np.argmin(np.abs(prefix[ends] - share[d] * prefix[-1]))]))
    b.append(cost.num_layers)
    return b


def move_boundary_layers(cost: CostModel, boundaries: list[int]) -> list[int]:
    """Phase 2 from a split that fits: move boundary layers of the most loaded stage to a
    neighbour while that brings every stage it touches under the current maximum; returns the
    boundaries.

    The stage gives away as few boundary layers as make it (and what it keeps) faster than the
    maximum; a neighbour that would then reach the maximum passes as few of its own far
    boundary layers on in the same direction, and so on down the pipeline. Without this chain a
    stage between two busy neighbours keeps the bottleneck although farther devices idle (the
    anchor's sweep over all boundaries spreads load the same way). Of the two directions, the
    one whose touched stages end lowest wins. Each move lowers the stage times sorted in
    decreasing order (lexicographically), so the loop ends; with several stages tied at the
    maximum, a move lowers one of them.
    """
    b = list(boundaries)
    times = _times(cost, b)
    while True:
        d = int(np.argmax(times))
        moves = [m for m in (_shed(cost, b, d, step, times[d]) for step in (-1, 1)) if m]
        if not moves:
            return b
        _, b = min(moves)
        times = _times(cost, b)


def _shed(cost: CostModel, b: list[int], d: int, step: int,
          top: float) -> tuple[float, list[int]] | None:
    """Stage d gives its boundary layers to stage d + step (step is -1 or +1), each stage on
    the way passing on as few as keep it under `top` seconds and within memory; returns (the
    highest touched stage time, new boundaries), or None when no such chain exists."""
    k = d
    new = list(b)
    highest = 0.0
    while 0 <= k + step < cost.num_devices:
        edge = k + 1 if step > 0 else k  # the boundary between stages k and k + step
        for moved in range(1, new[k + 1] - new[k]):
            trial = list(new)
            trial[edge] -= step * moved
            t = cost.stage_time_s(k, trial[k], trial[k + 1])
            if t < top and cost.fits(k, trial[k], trial[k + 1]):
                break
        else:
            return None
        new, highest, k = trial, max(highest, t), k + step
        t = cost.stage_time_s(k, new[k], new[k + 1])
        if t < top and cost.fits(k, new[k], new[k + 1]):
            return max(highest, t), new
    return None


def _times(cost: CostModel, b: list[int]) -> list[float]:
    return [cost.stage_time_s(d, b[d], b[d + 1]) for d in range(cost.num_devices)]
