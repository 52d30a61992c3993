"""Tree packing: Edmonds' bound reached within eps, capacities kept, the ILP keeps the rate."""

from __future__ import annotations

from itertools import product
from typing import Any

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services.collectives import Topology, TreePlan, minimize_trees, pack_trees
from salus.daemon.services.collectives.arborescence import min_arborescence
from salus.daemon.services.collectives.topology import Node

EPS = 0.05
NOT_A_PLAN: Any = "plan"


def min_cut_bound(topo: Topology, root: int) -> float:
    """min over devices v of the max flow root -> v, computed straight from the edge list."""
    g = nx.DiGraph()
    for s, d, cap, _kind in topo.edges():
        g.add_edge(s, d, capacity=g.get_edge_data(s, d, {"capacity": 0.0})["capacity"] + cap)
    return min(nx.maximum_flow_value(g, root, v) for v in topo.devices() if v != root)


def assert_valid_plan(plan: TreePlan) -> None:
    devices = set(plan.topology.devices())
    for edges, weight in plan.trees:
        assert weight > 0
        parents = {v: u for u, v in edges}
        assert len(parents) == len(edges) == len(devices) - 1, "one parent per non-root device"
        assert set(parents) == devices - {plan.root}
        seen = {plan.root}
        for u, v in edges:  # parents come first, so every edge hangs off the tree so far
            assert u in seen
            seen.add(v)
    for (edges, _w), routes in zip(plan.trees, plan.routes, strict=True):
        for (u, v), route in zip(edges, routes, strict=True):
            assert route[0][0] == u and route[-1][1] == v
            assert all(a[1] == b[0] for a, b in zip(route, route[1:], strict=False))
            assert all(isinstance(hop[1], str) for hop in route[:-1]), "relays are switches"
    capacity = plan.link_capacities()
    for key, load in plan.link_loads().items():
        assert load <= capacity[key] * (1 + 1e-9), f"link {key} over capacity"


@st.composite
def device_graphs(draw: st.DrawFn, switches: int = 0) -> tuple[Topology, int]:
    """Random multigraphs in which every device is reachable from the drawn root."""
    devices = draw(st.lists(st.integers(0, 40), min_size=2, max_size=6, unique=True))
    order = draw(st.permutations(devices))
    caps = st.integers(1, 40).map(float)
    links: list[tuple[Node, Node, float, str]] = [
        (draw(st.sampled_from(order[:i])), v, draw(caps), "nvlink")
        for i, v in enumerate(order) if i > 0]
    names = [f"sw{i}" for i in range(switches)]
    nodes: list[Node] = [*devices, *names]
    extra = draw(st.lists(st.tuples(st.sampled_from(nodes), st.sampled_from(nodes), caps,
                                    st.sampled_from(["nvlink", "pcie"])), max_size=14))
    links += [lk for lk in extra if lk[0] != lk[1]]
    return Topology(devices, links, names, name="random"), order[0]


@settings(max_examples=30, deadline=None)
@given(device_graphs())
def test_packing_reaches_the_min_cut_within_eps(case: tuple[Topology, int]) -> None:
    topo, root = case
    plan = pack_trees(topo, root, eps=EPS)
    bound = min_cut_bound(topo, root)
    assert_valid_plan(plan)
    assert plan.rate >= (1 - EPS) * bound
    assert plan.rate <= bound * (1 + 1e-9)
    assert plan.upper_bound <= bound * (1 + 1e-9)


@settings(max_examples=20, deadline=None)
@given(device_graphs(switches=2))
def test_packing_through_switches_is_certified(case: tuple[Topology, int]) -> None:
    topo, root = case
    plan = pack_trees(topo, root, eps=EPS)
    assert_valid_plan(plan)
    assert (1 - EPS) * plan.upper_bound <= plan.rate <= min_cut_bound(topo, root) * (1 + 1e-9)


@settings(max_examples=20, deadline=None)
@given(device_graphs(switches=1))
def test_ilp_keeps_the_rate_with_no_more_trees(case: tuple[Topology, int]) -> None:
    topo, root = case
    plan = pack_trees(topo, root, eps=EPS)
    fewer = minimize_trees(plan)
    assert_valid_plan(fewer)
    assert len(fewer.trees) <= len(plan.trees)
    assert fewer.rate >= (1 - EPS) * plan.rate * (1 - 1e-9)
    assert {e for e, _w in fewer.trees} <= {e for e, _w in plan.trees}


@pytest.mark.parametrize(("preset", "subset", "expected"), [
    # NVLink min cut into GPU 1 (0->1, 2->1 x2, 3->1 = 4 links) plus its PCIe downlink.
    (Topology.dgx1v, [0, 1, 2, 3], 4 * 25.0 + 12.0),
    # Each GPU takes 4 NVLinks at 20 GB/s plus 10 GB/s across the sockets.
    (Topology.dgx1p, list(range(8)), 4 * 20.0 + 10.0),
    # No NVLink reaches 0 from {6, 7}: the broadcast is held to the QPI hop.
    (Topology.dgx1v, [0, 6, 7], 10.0),
])
def test_presets_reach_their_bounds(preset: object, subset: list[int], expected: float) -> None:
    topo = preset().subgraph(subset)  # type: ignore[operator]
    assert min_cut_bound(topo, subset[0]) == pytest.approx(expected)
    plan = pack_trees(topo, subset[0], eps=0.02)
    assert_valid_plan(plan)
    assert 0.98 * expected <= plan.rate <= plan.upper_bound <= expected * (1 + 1e-9)


def test_ilp_on_dgx1v_needs_few_trees() -> None:
    plan = pack_trees(Topology.dgx1v(), 0)
    fewer = minimize_trees(plan)
    assert_valid_plan(fewer)
    assert len(fewer.trees) < len(plan.trees)
    assert fewer.rate >= (1 - plan.eps) * plan.rate


def cheapest_by_brute_force(cost: np.ndarray, root: int) -> float | None:
    """Try every choice of parents; None when no choice reaches every node from `root`."""
    n = len(cost)
    others = [v for v in range(n) if v != root]
    options = [[u for u in range(n) if u != v and np.isfinite(cost[u, v])] for v in others]
    best = None
    for parents in product(*options):
        up = dict(zip(others, parents, strict=True))
        if all(_reaches_root(v, up, root, n) for v in others):
            total = sum(cost[up[v], v] for v in others)
            best = total if best is None else min(best, total)
    return best


def _reaches_root(v: int, up: dict[int, int], root: int, n: int) -> bool:
    for _ in range(n):
        if v == root:
            return True
        v = up[v]
    return v == root


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n - 1),
    st.lists(st.one_of(st.just(np.inf), st.floats(0, 10)), min_size=n * n, max_size=n * n))))
def test_min_arborescence_is_the_cheapest(case: tuple[int, int, list[float]]) -> None:
    n, root, flat = case
    cost = np.array(flat).reshape(n, n)
    want = cheapest_by_brute_force(cost, root)
    if want is None:
        with pytest.raises(ValueError, match="cannot be reached"):
            min_arborescence(cost, root)
        return
    parent = min_arborescence(cost, root)
    assert parent[root] == -1
    up = {v: int(parent[v]) for v in range(n) if v != root}
    assert all(_reaches_root(v, up, root, n) for v in up)
    assert sum(cost[u, v] for v, u in up.items()) == pytest.approx(want, abs=1e-9)


def test_bad_planner_input_is_a_clear_error() -> None:
    topo = Topology.dgx1v().subgraph([0, 1, 2])
    with pytest.raises(ValueError, match="root 5 is not a device"):
        pack_trees(topo, 5)
    with pytest.raises(ValueError, match="eps"):
        pack_trees(topo, 0, eps=0.0)
    with pytest.raises(ValueError, match="at least two devices"):
        pack_trees(Topology.pcie_box(1), 0)
    cut = Topology([0, 1, 2], [(0, 1, 5.0, "nvlink"), (2, 1, 5.0, "nvlink")])
    with pytest.raises(ValueError, match=r"devices \[2\] cannot be reached"):
        pack_trees(cut, 0)
    with pytest.raises(TypeError, match="TreePlan"):
        minimize_trees(NOT_A_PLAN)
    plan = pack_trees(topo, 0)
    with pytest.raises(ValueError, match="does not extend the tree"):
        plan.with_trees([(((1, 2), (0, 1)), 1.0)], [plan.routes[0]])
    with pytest.raises(ValueError, match="must span all 3 devices"):
        plan.with_trees([(((0, 1),), 1.0)], [plan.routes[0][:1]])
