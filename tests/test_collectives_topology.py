"""Topology model: presets match the documented machines, subgraphs keep ids, JSON round-trips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services.collectives import Link, Topology
from salus.daemon.services.collectives.presets import DGX1V_NVLINKS

NOT_INTS: Any = ["gpu0"]


def nvlink_pairs(topo: Topology) -> Counter[tuple[int, int]]:
    """NVLink count per ordered GPU pair."""
    return Counter((s, d) for s, d, _c, kind in topo.edges()
                   if kind == "nvlink" and isinstance(s, int) and isinstance(d, int))


@pytest.mark.parametrize(("preset", "per_gpu", "nvlink_gbps"), [
    (Topology.dgx1p, 4, 20.0), (Topology.dgx1v, 6, 25.0)])
def test_dgx1_nvlink_counts_and_symmetry(preset: object, per_gpu: int, nvlink_gbps: float) -> None:
    topo = preset()  # type: ignore[operator]
    assert topo.devices() == list(range(8))
    pairs = nvlink_pairs(topo)
    for gpu in range(8):
        assert topo.link_count(gpu, "nvlink") == per_gpu
        assert sum(n for (_s, d), n in pairs.items() if d == gpu) == per_gpu
    assert all(pairs[a, b] == pairs[b, a] for a, b in pairs)
    assert sum(pairs.values()) == 8 * per_gpu
    assert {c for _s, _d, c, k in topo.edges() if k == "nvlink"} == {nvlink_gbps}
    # every GPU reaches every other over PCIe through the switches
    assert {k for *_x, k in topo.edges()} == {"nvlink", "pcie"}


def test_dgx1p_is_two_quads_joined_across() -> None:
    pairs = nvlink_pairs(Topology.dgx1p())
    within = {(a, b) for a in range(8) for b in range(8) if a != b and a // 4 == b // 4}
    across = {(i, i + 4) for i in range(4)} | {(i + 4, i) for i in range(4)}
    assert set(pairs) == within | across


def test_dgx1v_cube_mesh_has_eight_doubled_pairs() -> None:
    pairs = nvlink_pairs(Topology.dgx1v())
    doubled = {(a, b) for (a, b), n in pairs.items() if n == 2 and a < b}
    assert len(doubled) == 8 and len({(a, b) for a, b in pairs if a < b}) == 16
    assert doubled == {p for p, n in DGX1V_NVLINKS.items() if n == 2}


def test_dgx2_and_pcie_box_shapes() -> None:
    dgx2 = Topology.dgx2()
    assert dgx2.devices() == list(range(16)) and len(dgx2.switches()) == 12
    assert all(dgx2.link_count(g, "nvlink") == 6 for g in range(16))
    box = Topology.pcie_box(5)
    assert box.devices() == list(range(5)) and box.switches() == ["pcie0"]
    assert all(box.link_count(g, "pcie") == 1 for g in range(5))
    with pytest.raises(ValueError, match="positive device count"):
        Topology.pcie_box(0)


def test_subgraph_keeps_ids_order_and_prunes_dead_switches() -> None:
    full = Topology.dgx1v()
    sub = full.subgraph([6, 2, 7])
    assert sub.devices() == [6, 2, 7]
    nodes = set(sub.devices()) | set(sub.switches())
    assert all(s in nodes and d in nodes for s, d, _c, _k in sub.edges())
    # plx0 (GPUs 0, 1) is a dead end once they are gone; plx1 still joins GPU 2 to cpu0.
    assert "plx0" not in sub.switches() and {"plx1", "plx3", "cpu0", "cpu1"} <= set(
        sub.switches())
    assert nvlink_pairs(sub) == Counter(
        {k: n for k, n in nvlink_pairs(full).items() if set(k) <= {6, 2, 7}})
    with pytest.raises(ValueError, match="not in topology"):
        full.subgraph([0, 8])
    with pytest.raises(ValueError, match="repeat"):
        full.subgraph([1, 1])


@pytest.mark.parametrize("preset", [Topology.dgx1p, Topology.dgx1v, Topology.dgx2])
def test_preset_json_round_trip(preset: object, tmp_path: Path) -> None:
    topo = preset()  # type: ignore[operator]
    path = tmp_path / "topo.json"
    topo.save(path)
    back = Topology.load(path)
    assert back == topo and back.devices() == topo.devices() and back.name == topo.name
    assert Counter(back.edges()) == Counter(topo.edges())


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    devices = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True))
    switches = [f"sw{i}" for i in range(draw(st.integers(0, 2)))]
    nodes: list[int | str] = [*devices, *switches]
    links = draw(st.lists(st.tuples(st.sampled_from(nodes), st.sampled_from(nodes),
                                    st.floats(0.5, 100.0), st.sampled_from(
                                        ["nvlink", "pcie", "network"])), max_size=15))
    return Topology(devices, [lk for lk in links if lk[0] != lk[1]], switches, name="random")


@settings(max_examples=40, deadline=None)
@given(topologies())
def test_random_topology_json_round_trip(topo: Topology) -> None:
    back = Topology.from_dict(topo.to_dict())
    assert back == topo
    assert back.devices() == topo.devices() and back.switches() == topo.switches()


def test_bad_topologies_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="not in the topology"):
        Topology([0, 1], [(0, 2, 10.0, "nvlink")])
    with pytest.raises(ValueError, match="capacity must be > 0"):
        Topology([0, 1], [(0, 1, 0.0, "nvlink")])
    with pytest.raises(ValueError, match="kind 'infiniband'"):
        Topology([0, 1], [Link(0, 1, 1.0, "infiniband")])
    with pytest.raises(ValueError, match="self-loop"):
        Topology([0, 1], [(1, 1, 1.0, "pcie")])
    with pytest.raises(TypeError, match="non-negative ints"):
        Topology(NOT_INTS, [])
    with pytest.raises(ValueError, match="repeat"):
        Topology([0, 0], [])
    with pytest.raises(ValueError, match="lacks"):
        Topology.from_dict({"devices": [0]})
    with pytest.raises(ValueError, match="capacity_gbps"):
        Topology.from_dict({"devices": [0, 1], "links": [{"src": 0, "dst": 1}]})


def test_probe_without_nvml_says_what_to_install() -> None:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="nvidia-ml-py"):
            Topology.probe()
    else:
        pytest.skip("nvidia-ml-py is installed; probing needs a GPU machine")
