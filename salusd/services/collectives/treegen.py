"""Blink TreeGen: pack spanning arborescences by multiplicative weights, then certify the rate.

The packing LP is: maximise the sum of tree weights such that, on every pooled link, the weights
of the trees crossing it (times the number of crossings) stay within its capacity. Its optimum
is the best broadcast rate from the root; with no switches it equals min over devices v of the
min cut root -> v (Edmonds). `pack_trees` runs the Garg-Koenemann multiplicative-weights method:
each round the cheapest arborescence under the current link lengths (Chu-Liu/Edmonds) gets the
flow its bottleneck allows, and every link it crosses gets longer. The trees it finds are then
re-weighted by the LP restricted to them (scipy HiGHS), and the planner stops once that rate is
within (1 - eps) of a proven upper bound: the min cut, the MWU dual bound D(l) / alpha(l), or
the bound from the LP duals. If the MWU ends first, column generation on the LP duals finishes
the job, so the (1 - eps) guarantee holds whenever `pack_trees` returns within `max_rounds`.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
from scipy.optimize import linprog

from .arborescence import min_arborescence
from .fabric import Fabric, Route
from .plan import Edge, TreePlan
from .topology import Topology

_RENORMALISE = 1e100


class _Tree:
    """One spanning arborescence: edges (parents first), their routes, and its link use."""

    def __init__(self, edges: tuple[Edge, ...], routes: tuple[Route, ...], fabric: Fabric):
        self.edges = edges
        self.routes = routes
        self.use = fabric.use_vector(routes)
        self.key = tuple(sorted(zip(edges, routes, strict=True)))


class ArborescenceOracle:
    """The cheapest spanning arborescence rooted at `root` under per-link lengths.

    A device pair (u, v) costs its cheapest route (the summed lengths of the pooled links it
    crosses); `min_arborescence` (Chu-Liu/Edmonds) picks the tree."""

    def __init__(self, fabric: Fabric, root: int) -> None:
        self.fabric = fabric
        self.devices = fabric.devices
        self.pairs = list(fabric.routes)
        self._pair_index = {p: i for i, p in enumerate(self.pairs)}
        pos = {d: i for i, d in enumerate(self.devices)}
        self._root = pos[root]
        self._src = np.array([pos[u] for u, _v in self.pairs])
        self._dst = np.array([pos[v] for _u, v in self.pairs])
        most = max(len(fabric.routes[p]) for p in self.pairs)
        longest = max(len(r) for rs in fabric.routes.values() for r in rs)
        pad = len(fabric.keys)  # index of an extra slot: zero length, or inf for no route
        self._routes = np.full((len(self.pairs), most, longest), pad, dtype=np.intp)
        self._missing = np.ones((len(self.pairs), most), dtype=bool)
        for i, p in enumerate(self.pairs):
            for j, r in enumerate(fabric.routes[p]):
                self._routes[i, j, : len(r)] = r
                self._missing[i, j] = False

    def __call__(self, lengths: np.ndarray) -> tuple[_Tree, float]:
        """(tree, cost) for link `lengths` (one per pooled link, >= 0)."""
        per_route = np.append(lengths, 0.0)[self._routes].sum(axis=2)
        per_route[self._missing] = np.inf
        pick = per_route.argmin(axis=1)
        n = len(self.devices)
        cost = np.full((n, n), np.inf)
        cost[self._src, self._dst] = per_route[np.arange(len(self.pairs)), pick]
        parent = min_arborescence(cost, self._root)
        children: dict[int, list[int]] = {}
        for v, u in enumerate(parent.tolist()):
            if u >= 0:
                children.setdefault(u, []).append(v)
        order, edges = [self._root], []
        for u in order:  # breadth first, so parents come before children
            for v in children.get(u, []):
                order.append(v)
                edges.append((self.devices[u], self.devices[v]))
        routes = []
        for e in edges:
            i = self._pair_index[e]
            routes.append(self.fabric.routes[e][int(pick[i])])
        tree = _Tree(tuple(edges), tuple(routes), self.fabric)
        return tree, float(tree.use @ lengths)


def max_rate_lp(use: np.ndarray, capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max-rate tree weights (GB/s) for link-use matrix `use` (links x trees) and the capacity
    duals, by HiGHS; weights are scaled so no link ends over capacity."""
    res = linprog(-np.ones(use.shape[1]), A_ub=use, b_ub=capacity, bounds=(0, None),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"the tree-packing LP failed: {res.message}")
    weights = np.asarray(res.x)
    # HiGHS meets constraints to ~1e-9; scale so no link is ever over capacity.
    over = float(np.max((use @ weights) / capacity))
    return weights / max(over, 1.0), -np.asarray(res.ineqlin.marginals)


def _restricted_lp(columns: list[_Tree], capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return max_rate_lp(np.stack([c.use for c in columns], axis=1), capacity)


def _check_inputs(topology: Topology, root: int, eps: float) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(f"pack_trees needs a Topology, got {type(topology).__name__}")
    if root not in topology.devices():
        raise ValueError(f"root {root!r} is not a device of {topology.name!r}: "
                         f"choose one of {topology.devices()}")
    if len(topology.devices()) < 2:
        raise ValueError("a broadcast plan needs at least two devices")
    if not 0.0 < eps <= 0.5:
        raise ValueError(f"eps must be in (0, 0.5], got {eps}")


def pack_trees(topology: Topology, root: int, eps: float = 0.05, *,
               max_rounds: int = 20000) -> TreePlan:
    """A packing of spanning arborescences rooted at `root` whose rate (GB/s) is within
    (1 - eps) of the best broadcast rate the topology allows, with no link over capacity.

    `max_rounds` caps the oracle calls; a plan cut short still respects capacities, and its
    `upper_bound` says how far from optimal it may be."""
    _check_inputs(topology, root, eps)
    fabric = Fabric(topology)
    reach = nx.descendants(nx.DiGraph(list(fabric.routes)), root)
    lost = [d for d in topology.devices() if d != root and d not in reach]
    if lost:
        raise ValueError(f"devices {lost} cannot be reached from root {root} in {topology.name!r}")
    cap = fabric.capacity
    oracle = ArborescenceOracle(fabric, root)
    columns: dict[tuple[object, ...], _Tree] = {}
    bound = fabric.min_cut(root)

    # Garg-Koenemann lengths delta / c, kept normalised: true length = l * exp(log_scale).
    log_delta = math.log1p(eps) - math.log((1 + eps) * len(cap)) / eps
    lengths = (1.0 / cap) / (1.0 / cap).max()
    log_scale = log_delta + math.log((1.0 / cap).max())
    mwu_done = False
    weights = np.zeros(0)
    next_check = 4
    for round_ in range(1, max_rounds + 1):
        if not mwu_done:
            tree, cost = oracle(lengths)
            columns.setdefault(tree.key, tree)
            total = float(cap @ lengths)
            bound = min(bound, total / cost)
            mwu_done = math.log(total) + log_scale >= 0.0
            if not mwu_done:
                used = tree.use > 0
                step = float((cap[used] / tree.use[used]).min())
                lengths[used] *= 1.0 + eps * step * tree.use[used] / cap[used]
                top = float(lengths.max())
                if top > _RENORMALISE:
                    lengths /= top
                    log_scale += math.log(top)
        if mwu_done or round_ >= next_check:
            weights, duals = _restricted_lp(list(columns.values()), cap)
            value = float(weights.sum())
            if value >= (1 - eps) * bound:
                break
            # Column generation: the cheapest tree under the LP duals also bounds the optimum.
            dual_tree, dual_cost = oracle(duals)
            if dual_cost > 0:
                bound = min(bound, float(cap @ duals) / dual_cost)
            columns.setdefault(dual_tree.key, dual_tree)
            next_check = round_ + max(4, round_ // 8)
    cols = list(columns.values())
    if len(weights) != len(cols):
        weights, _ = _restricted_lp(cols, cap)
    return _as_plan(topology, root, eps, fabric, cols, weights, bound)


def _as_plan(topology: Topology, root: int, eps: float, fabric: Fabric, cols: list[_Tree],
             weights: np.ndarray, bound: float) -> TreePlan:
    keep = [i for i in np.argsort(-weights) if weights[i] > 1e-9 * max(1.0, weights.max())]
    trees = tuple((cols[i].edges, float(weights[i])) for i in keep)
    routes = tuple(tuple(fabric.route_keys(r) for r in cols[i].routes) for i in keep)
    return TreePlan(topology, root, trees, routes, bound, eps, explored=len(cols))
