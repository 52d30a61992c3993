"""Rings as NCCL builds them, for comparison with packed trees.

A ring visits every device once and closes; data moves around it, so it runs at the capacity
of its slowest hop (a link crossed twice by one ring counts twice). The model, NCCL-style:
rings are found one after another on the capacity earlier rings leave, each the Hamiltonian
cycle with the largest bottleneck; a hop takes the route (NVLink, or a PCIe path through the
switches) with the most capacity left. The search is exhaustive over cycles for up to
`EXHAUSTIVE_MAX` devices and greedy (widest next hop from every start) beyond. The model is
generous to rings: NCCL does not add PCIe rings on top of NVLink rings, this model does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import permutations

import numpy as np

from .fabric import Fabric, LinkKey, Route
from .plan import TreePlan
from .topology import Topology

EXHAUSTIVE_MAX = 9


@dataclass(frozen=True)
class Ring:
    """Devices in ring order (data flows order[i] -> order[i+1], last -> first), the ring's
    rate in GB/s and the pooled links `(src, dst, kind)` each hop crosses."""

    order: tuple[int, ...]
    rate: float
    routes: tuple[tuple[LinkKey, ...], ...]


def _widest_routes(fabric: Fabric, residual: np.ndarray) -> dict[tuple[int, int], Route]:
    widest: dict[tuple[int, int], Route] = {}
    for pair, routes in fabric.routes.items():
        widest[pair] = max(routes, key=lambda r: (min(residual[i] for i in r), -len(r)))
    return widest


def _cycle_rate(order: Sequence[int], hops: dict[tuple[int, int], Route],
                residual: np.ndarray) -> float:
    use: Counter[int] = Counter()
    for u, v in zip(order, (*order[1:], order[0]), strict=True):
        route = hops.get((u, v))
        if route is None:
            return 0.0
        use.update(route)
    return min(residual[i] / n for i, n in use.items())


def _candidates(devices: list[int], hops: dict[tuple[int, int], Route],
                residual: np.ndarray) -> Iterator[tuple[int, ...]]:
    first, rest = devices[0], devices[1:]
    if len(devices) <= EXHAUSTIVE_MAX:
        for perm in permutations(rest):
            yield (first, *perm)
        return
    for start in devices:
        order = [start]
        left = set(devices) - {start}
        while left:
            here = order[-1]
            order.append(max(sorted(left), key=lambda v: min(
                (residual[i] for i in hops.get((here, v), ())), default=0.0)))
            left.discard(order[-1])
        yield tuple(order)


def best_ring(topology: Topology, fabric: Fabric | None = None,
              residual: np.ndarray | None = None) -> Ring | None:
    """The ring with the largest bottleneck on `residual` capacity (GB/s per pooled link of
    `fabric`; default: full capacity), or None when no ring has capacity left."""
    fabric = fabric or Fabric(topology)
    residual = fabric.capacity.copy() if residual is None else residual
    devices = topology.devices()
    if len(devices) < 2:
        raise ValueError("a ring needs at least two devices")
    hops = _widest_routes(fabric, residual)
    best: tuple[float, tuple[int, ...]] = (0.0, ())
    for order in _candidates(devices, hops, residual):
        rate = _cycle_rate(order, hops, residual)
        if rate > best[0]:
            best = (rate, order)
    rate, order = best
    if rate <= 0.0:
        return None
    routes = tuple(fabric.route_keys(hops[u, v])
                   for u, v in zip(order, (*order[1:], order[0]), strict=True))
    return Ring(order, float(rate), routes)


def pack_rings(topology: Topology, max_rings: int = 64) -> list[Ring]:
    """NCCL-style rings: widest ring first, then the widest on what is left, and so on, until
    no ring gains more than 1e-9 of the largest link capacity or `max_rings` are found."""
    fabric = Fabric(topology)
    residual = fabric.capacity.copy()
    tiny = 1e-9 * float(residual.max())
    rings: list[Ring] = []
    while len(rings) < max_rings:
        ring = best_ring(topology, fabric, residual)
        if ring is None or ring.rate <= tiny:
            break
        rings.append(ring)
        for route in ring.routes:
            for i in fabric.route_index(route):
                residual[i] -= ring.rate
        np.maximum(residual, 0.0, out=residual)
    return rings


def ring_rate(topology: Topology, max_rings: int = 64) -> float:
    """Broadcast rate in GB/s of the packed rings (data split across them by rate)."""
    return sum(r.rate for r in pack_rings(topology, max_rings))


def ring_plan(topology: Topology, root: int, rings: Sequence[Ring] | None = None) -> TreePlan:
    """Rings as a `TreePlan` of chains from `root` (each ring minus its hop into `root`), so the
    tree executor and timer run ring broadcasts too."""
    rings = pack_rings(topology) if rings is None else rings
    if not rings:
        raise ValueError(f"no ring connects the devices of {topology.name!r}")
    trees, routes = [], []
    for ring in rings:
        at = ring.order.index(root)
        order = ring.order[at:] + ring.order[:at]
        hops = ring.routes[at:] + ring.routes[:at]
        trees.append((tuple(zip(order, order[1:], strict=False)), ring.rate))
        routes.append(hops[:-1])
    fabric = Fabric(topology)
    return TreePlan(topology, root, tuple(trees), tuple(routes), fabric.min_cut(root), 0.0,
                    explored=len(rings))
