"""Rings: valid cycles within capacity, and never faster than packed trees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services.collectives import (
    Topology,
    best_ring,
    pack_rings,
    pack_trees,
    ring_plan,
    ring_rate,
)
from salus.daemon.services.collectives.rings import Ring

EPS = 0.05


def assert_rings_fit(topo: Topology, rings: list[Ring]) -> None:
    capacity: dict[tuple[object, object, str], float] = {}
    for s, d, cap, kind in topo.edges():
        capacity[s, d, kind] = capacity.get((s, d, kind), 0.0) + cap
    load: dict[tuple[object, object, str], float] = {}
    for ring in rings:
        assert sorted(ring.order) == sorted(topo.devices()) and ring.rate > 0
        hops = zip(ring.order, (*ring.order[1:], ring.order[0]), strict=True)
        for (u, v), route in zip(hops, ring.routes, strict=True):
            assert route[0][0] == u and route[-1][1] == v
            for key in route:
                load[key] = load.get(key, 0.0) + ring.rate
    assert all(load[k] <= capacity[k] * (1 + 1e-9) for k in load)


@st.composite
def symmetric_graphs(draw: st.DrawFn) -> Topology:
    """Random undirected-style multigraphs (each link both ways) plus one PCIe switch."""
    n = draw(st.integers(2, 6))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                                    st.integers(1, 30)), max_size=12))
    links = [(0, "sw", 7.0, "pcie"), ("sw", 0, 7.0, "pcie")]
    links += [(d, "sw", 12.0, "pcie") for d in range(1, n)]
    links += [("sw", d, 12.0, "pcie") for d in range(1, n)]
    for a, b, cap in pairs:
        if a != b:
            links += [(a, b, float(cap), "nvlink"), (b, a, float(cap), "nvlink")]
    return Topology(range(n), links, ["sw"], name="random")


@settings(max_examples=25, deadline=None)
@given(symmetric_graphs())
def test_packed_rings_fit_and_trees_are_never_slower(topo: Topology) -> None:
    rings = pack_rings(topo)
    assert_rings_fit(topo, rings)
    rate = sum(r.rate for r in rings)
    assert rate >= 7.0 - 1e-9, "the PCIe switch alone carries a ring"
    plan = pack_trees(topo, 0, eps=EPS)
    assert plan.rate >= (1 - EPS) * rate
    assert rate <= plan.upper_bound * (1 + 1e-9)


def test_known_rates() -> None:
    # One directed cycle: one ring at its capacity.
    cycle = Topology(range(3), [(0, 1, 5.0, "nvlink"), (1, 2, 5.0, "nvlink"),
                                (2, 0, 5.0, "nvlink")])
    assert ring_rate(cycle) == pytest.approx(5.0)
    # A bidirectional 4-cycle holds a ring each way.
    four = [(i, (i + 1) % 4) for i in range(4)]
    both = Topology(range(4), [(a, b, 9.0, "nvlink") for a, b in four]
                    + [(b, a, 9.0, "nvlink") for a, b in four])
    assert ring_rate(both) == pytest.approx(18.0)
    # Behind one PCIe switch every hop crosses an uplink and a downlink once.
    assert ring_rate(Topology.pcie_box(4)) == pytest.approx(12.0)
    # The fully NVLinked DGX-1V quad: the best single ring is held to its single links.
    ring = best_ring(Topology.dgx1v().subgraph([0, 1, 2, 3]))
    assert ring is not None and ring.rate == pytest.approx(25.0)


def test_rings_fall_back_to_pcie_where_trees_keep_nvlink() -> None:
    # GPU 4 has one NVLink neighbour (0) in this set, so every ring crosses QPI.
    topo = Topology.dgx1v().subgraph([0, 1, 2, 3, 4])
    rings = pack_rings(topo)
    assert_rings_fit(topo, rings)
    assert all(any(k[2] == "pcie" for route in r.routes for k in route) for r in rings)
    assert pack_trees(topo, 0).rate >= 2.5 * sum(r.rate for r in rings)


def test_greedy_search_beyond_exhaustive_size() -> None:
    rings = pack_rings(Topology.dgx2())
    assert_rings_fit(Topology.dgx2(), rings)
    assert sum(r.rate for r in rings) == pytest.approx(150.0)


def test_ring_plan_is_chains_from_the_root() -> None:
    topo = Topology.dgx1v().subgraph([3, 5, 6])
    plan = ring_plan(topo, 5)
    assert plan.root == 5 and plan.rate == pytest.approx(ring_rate(topo))
    for edges, _w in plan.trees:
        assert edges[0][0] == 5 and all(a[1] == b[0] for a, b in zip(edges, edges[1:],
                                                                      strict=False))
        assert len(edges) == 2
    with pytest.raises(ValueError, match="at least two devices"):
        best_ring(Topology.pcie_box(1))
