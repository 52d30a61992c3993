"""`TreePlan`: the decision a planner hands to the executor and the timer (a frozen dataclass)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .fabric import Fabric, LinkKey
from .topology import Topology

Edge = tuple[int, int]


@dataclass(frozen=True)
class TreePlan:
    """Spanning arborescences rooted at `root`, each carrying `weight` GB/s of a broadcast.

    `trees[i] = (edges, weight)`: `edges` are `(src, dst)` device pairs, parents before
    children; `routes[i][j]` lists the pooled links `(src, dst, kind)` that edge j of tree i
    crosses. `upper_bound` (GB/s) is a certified bound on any broadcast rate from `root` on this
    topology, so `rate / upper_bound` is the planner's proven accuracy. `explored` counts the
    distinct trees the planner generated on the way."""

    topology: Topology
    root: int
    trees: tuple[tuple[tuple[Edge, ...], float], ...]
    routes: tuple[tuple[tuple[LinkKey, ...], ...], ...]
    upper_bound: float
    eps: float
    explored: int = 0

    def __post_init__(self) -> None:
        devices = set(self.topology.devices())
        if self.root not in devices:
            raise ValueError(f"root {self.root} is not a device of {self.topology.name!r}")
        if len(self.routes) != len(self.trees):
            raise ValueError("a TreePlan needs one route list per tree")
        for i, ((edges, weight), routes) in enumerate(zip(self.trees, self.routes, strict=True)):
            reached = {self.root}
            for u, v in edges:
                if u not in reached or v in reached:
                    raise ValueError(f"tree {i}: edge {u}->{v} does not extend the tree from "
                                     f"root {self.root} (list parents before children)")
                reached.add(v)
            if reached != devices or len(routes) != len(edges) or not weight > 0:
                raise ValueError(f"tree {i} must span all {len(devices)} devices with one route "
                                 "per edge and a positive weight (GB/s)")

    @cached_property
    def fabric(self) -> Fabric:
        """Pooled links and routes of `topology` (built once, on first use)."""
        return Fabric(self.topology)

    @property
    def rate(self) -> float:
        """Broadcast rate of the whole plan in GB/s: the sum of the tree weights."""
        return sum(w for _edges, w in self.trees)

    def weights(self) -> list[float]:
        """The tree weights in GB/s, in tree order."""
        return [w for _edges, w in self.trees]

    def link_loads(self) -> dict[LinkKey, float]:
        """GB/s each pooled link `(src, dst, kind)` carries when every tree runs at its weight."""
        loads: dict[LinkKey, float] = {}
        for (_edges, weight), routes in zip(self.trees, self.routes, strict=True):
            for route in routes:
                for key in route:
                    loads[key] = loads.get(key, 0.0) + weight
        return loads

    def link_capacities(self) -> dict[LinkKey, float]:
        """Capacity in GB/s of each pooled link (parallel links of one kind summed)."""
        return dict(zip(self.fabric.keys, self.fabric.capacity.tolist(), strict=True))

    def with_trees(self, trees: Sequence[tuple[tuple[Edge, ...], float]],
                   routes: Sequence[tuple[tuple[LinkKey, ...], ...]]) -> TreePlan:
        """The same plan over another set of trees (the bound and topology stay)."""
        return TreePlan(self.topology, self.root, tuple(trees), tuple(routes), self.upper_bound,
                        self.eps, self.explored)
