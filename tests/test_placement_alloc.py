"""Placement allocators: contiguous covering stages within memory, or a clear infeasibility;
optimal <= sky <= even; the MILP equals brute force over every split."""

from __future__ import annotations

import os
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services.placement import (
    ClusterProfile,
    CostModel,
    DeviceProfile,
    LayerProfile,
    LinkProfile,
    ModelProfile,
    PlacementInfeasible,
    Plan,
    allocate_even,
    allocate_optimal,
    allocate_sky,
)
from salus.daemon.services.placement.feasibility import placeable_suffixes
from salus.daemon.services.placement.sky import (
    memory_proportional_boundaries,
    move_boundary_layers,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
REL = 1e-6


def layer(i: int, flops: int, traffic: int, memory: int, out: int) -> LayerProfile:
    return LayerProfile(name=f"l{i}", param_bytes=memory, grad_bytes=0, optimizer_bytes=0,
                        activation_bytes=0, output_bytes=out, forward_flops=flops,
                        backward_flops=2 * flops, forward_bytes_accessed=traffic,
                        backward_bytes_accessed=traffic)


@st.composite
def instances(draw: st.DrawFn) -> tuple[ModelProfile, ClusterProfile]:
    num_l = draw(st.integers(1, 9))
    num_d = draw(st.integers(1, 4))
    ints = st.integers(1, 1000)
    layers = tuple(layer(i, draw(ints), draw(ints), draw(st.integers(1, 100)), draw(ints))
                   for i in range(num_l))
    devices = tuple(
        DeviceProfile(f"d{d}", float(draw(ints)), float(draw(ints)), draw(st.integers(1, 400)))
        for d in range(num_d))
    lat = tuple(tuple(0.0 if i == j else float(draw(st.integers(0, 5))) for j in range(num_d))
                for i in range(num_d))
    bw = tuple(tuple(0.0 if i == j else float(draw(ints)) for j in range(num_d))
               for i in range(num_d))
    return ModelProfile(layers, 1), ClusterProfile(devices, LinkProfile(lat, bw))


def stage_s(model: ModelProfile, cluster: ClusterProfile, d: int, a: int, b: int) -> float:
    """The cost model written out again from its definition, independently of CostModel."""
    dev = cluster.devices[d]
    compute = 0.0
    for lay in model.layers[a:b]:
        flops = lay.forward_flops + lay.backward_flops
        traffic = lay.forward_bytes_accessed + lay.backward_bytes_accessed
        compute += max(flops / dev.flops_per_s, traffic / dev.bytes_per_s)
    if d == len(cluster.devices) - 1:
        return compute
    links = cluster.links
    return compute + 2 * (links.latency_s[d][d + 1]
                          + model.layers[b - 1].output_bytes
                          / links.bandwidth_bytes_per_s[d][d + 1])


def stage_bytes(model: ModelProfile, a: int, b: int) -> int:
    return sum(lay.param_bytes for lay in model.layers[a:b])


def brute_force(model: ModelProfile, cluster: ClusterProfile) -> float | None:
    """The least bottleneck time over every contiguous split that fits, or None if none."""
    num_l, num_d = len(model.layers), len(cluster.devices)
    best = None
    for cuts in combinations(range(1, num_l), num_d - 1):
        b = (0, *cuts, num_l)
        if all(stage_bytes(model, b[d], b[d + 1]) <= cluster.devices[d].memory_bytes
               for d in range(num_d)):
            worst = max(stage_s(model, cluster, d, b[d], b[d + 1]) for d in range(num_d))
            best = worst if best is None else min(best, worst)
    return best


def check_plan(plan: Plan, model: ModelProfile, cluster: ClusterProfile) -> None:
    b = plan.boundaries
    covered = [i for stage in plan.stages() for i in stage]
    assert covered == list(range(len(model.layers)))
    assert len(plan.stages()) == len(cluster.devices)
    assert all(len(stage) >= 1 for stage in plan.stages())
    for d, dev in enumerate(cluster.devices):
        assert stage_bytes(model, b[d], b[d + 1]) <= dev.memory_bytes
        assert plan.stage_memory_bytes[d] == stage_bytes(model, b[d], b[d + 1])
        assert plan.stage_times_s[d] == pytest.approx(stage_s(model, cluster, d, b[d], b[d + 1]),
                                                      rel=1e-9)
    assert plan.planning_s >= 0


@settings(max_examples=300, deadline=None)
@given(instances())
def test_allocators_place_every_layer_once_within_memory(
        inst: tuple[ModelProfile, ClusterProfile]) -> None:
    model, cluster = inst
    cost = CostModel(model, cluster)
    best = brute_force(model, cluster)
    plans = {}
    for name, allocate in (("even", allocate_even), ("sky", allocate_sky),
                           ("optimal", allocate_optimal)):
        try:
            plans[name] = allocate(cost)
        except PlacementInfeasible as exc:
            assert str(exc)
            # Only even may give up while some split fits: its split is fixed.
            assert name == "even" or best is None
        else:
            check_plan(plans[name], model, cluster)
    if best is None:
        assert plans == {}
        return
    sky, opt = plans["sky"], plans["optimal"]
    assert opt.status == "optimal"
    assert opt.max_stage_time_s == pytest.approx(best, rel=REL)
    assert opt.max_stage_time_s <= sky.max_stage_time_s * (1 + REL)
    if "even" in plans:
        assert sky.max_stage_time_s <= plans["even"].max_stage_time_s


def blocked_instance() -> CostModel:
    """Memory-proportional phase 1 ignores speed: it leaves the heavy layer 1 alone on the
    slow device 1, and a stage of one layer has nothing to shed."""
    flops_memory = [(4, 6), (8, 8), (2, 3), (3, 1), (3, 2)]
    layers = tuple(layer(i, f, 0, m, 0) for i, (f, m) in enumerate(flops_memory))
    devices = tuple(DeviceProfile(f"d{i}", s, 1.0, mem)
                    for i, (s, mem) in enumerate([(9.0, 22), (3.0, 12), (9.0, 29)]))
    zeros = tuple((0.0,) * 3 for _ in range(3))
    ones = tuple((1.0,) * 3 for _ in range(3))
    return CostModel(ModelProfile(layers, 1), ClusterProfile(devices, LinkProfile(zeros, ones)))


def test_sky_falls_back_on_the_even_start_when_its_own_start_is_stuck() -> None:
    cost = blocked_instance()
    own = move_boundary_layers(cost, memory_proportional_boundaries(cost,
                                                                    placeable_suffixes(cost)))
    assert own == [0, 1, 2, 5]
    own_max = max(cost.stage_time_s(d, own[d], own[d + 1]) for d in range(3))
    even = allocate_even(cost)
    assert own_max > even.max_stage_time_s
    sky = allocate_sky(cost)
    assert sky.max_stage_time_s <= even.max_stage_time_s
    assert allocate_optimal(cost).max_stage_time_s <= sky.max_stage_time_s


def test_memory_proportional_start_follows_the_memory_budgets() -> None:
    layers = tuple(layer(i, 1, 0, 10, 0) for i in range(12))
    devices = tuple(DeviceProfile(f"d{i}", 1.0, 1.0, mem) for i, mem in enumerate([60, 30, 30]))
    zeros = tuple((0.0,) * 3 for _ in range(3))
    ones = tuple((1.0,) * 3 for _ in range(3))
    cost = CostModel(ModelProfile(layers, 1), ClusterProfile(devices, LinkProfile(zeros, ones)))
    assert memory_proportional_boundaries(cost, placeable_suffixes(cost)) == [0, 6, 9, 12]


def test_infeasible_reports_why() -> None:
    layers = tuple(layer(i, 1, 0, 50, 0) for i in range(3))
    devices = (DeviceProfile("a", 1.0, 1.0, 60), DeviceProfile("b", 1.0, 1.0, 60))
    zeros = tuple((0.0,) * 2 for _ in range(2))
    ones = tuple((1.0,) * 2 for _ in range(2))
    cost = CostModel(ModelProfile(layers, 1), ClusterProfile(devices, LinkProfile(zeros, ones)))
    with pytest.raises(PlacementInfeasible, match="layers 0..1, which need 100 bytes"):
        allocate_even(cost)
    for allocate in (allocate_sky, allocate_optimal):
        with pytest.raises(PlacementInfeasible, match="need 150 bytes; the devices have 120"):
            allocate(cost)


def test_iteration_time_of_a_gpipe_plan() -> None:
    plan = Plan("x", (0, 1, 2), (2.0, 4.0), (1, 1), 0.0, "even")
    # 4 micro-batches: 0.5 + 1.0 to fill, then 3 more at the bottleneck's 1.0 each.
    assert plan.iteration_time_s(4) == pytest.approx(4.5)
    assert plan.iteration_time_s(1) == pytest.approx(6.0)
