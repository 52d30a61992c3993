"""Tree broadcast and allreduce on CPU devices, and the link-model timer."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services.collectives import (
    Topology,
    TreePlan,
    minimize_trees,
    pack_trees,
    ring_plan,
    simulate,
    tree_allreduce,
    tree_broadcast,
)

NOT_A_TENSOR: Any = [0.0] * 4
UNKNOWN_OP: Any = "gather"
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]


@cache
def plans() -> dict[str, TreePlan]:
    v = Topology.dgx1v()
    return {
        "dgx1v-3": pack_trees(v.subgraph([4, 1, 0]), 1),
        "dgx1v-8-ilp": minimize_trees(pack_trees(v, 3)),
        "dgx1p-5": pack_trees(Topology.dgx1p().subgraph([0, 1, 2, 3, 4]), 0),
        "pcie-4": pack_trees(Topology.pcie_box(4), 2),
        "ring-dgx1v-5": ring_plan(v.subgraph([0, 1, 2, 3, 4]), 0),
    }


def inputs(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Small integers, so every dtype (bfloat16 too) sums them exactly in any order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, shape, generator=g).to(dtype) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(plans())), numel=st.integers(0, 3001),
       chunk_bytes=st.integers(1, 5000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_allreduce_equals_the_sum(name: str, numel: int, chunk_bytes: int, dtype: torch.dtype,
                                  seed: int) -> None:
    plan = plans()[name]
    xs = inputs(len(plan.topology.devices()), (numel,), dtype, seed)
    want = torch.stack(xs).sum(0).to(dtype)
    assert tree_allreduce(xs, plan, chunk_bytes=chunk_bytes) is None
    for x in xs:
        assert torch.equal(x, want)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(plans())), rows=st.integers(1, 9), cols=st.integers(1, 301),
       chunk_bytes=st.integers(1, 3000), dtype=st.sampled_from(DTYPES))
def test_broadcast_copies_the_root_everywhere(name: str, rows: int, cols: int, chunk_bytes: int,
                                              dtype: torch.dtype) -> None:
    plan = plans()[name]
    xs = inputs(len(plan.topology.devices()), (rows, cols), dtype, rows * cols)
    root = xs[plan.topology.devices().index(plan.root)].clone()
    tree_broadcast(xs, plan, chunk_bytes=chunk_bytes)
    assert all(torch.equal(x, root) for x in xs)


def test_float_allreduce_and_async_handle() -> None:
    plan = plans()["dgx1v-8-ilp"]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4097, generator=g) for _ in range(8)]
    want = torch.stack(xs).double().sum(0)
    work = tree_allreduce(xs, plan, chunk_bytes=1000, async_op=True)
    assert work is not None and work.wait(timeout=60) and work.is_completed()
    for x in xs:
        torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_tensors_are_clear_errors() -> None:
    plan = plans()["dgx1v-3"]
    with pytest.raises(ValueError, match="spans 3 devices but 2 tensors"):
        tree_allreduce([torch.zeros(4)] * 2, plan)
    with pytest.raises(ValueError, match="must match"):
        tree_allreduce([torch.zeros(4), torch.zeros(5), torch.zeros(4)], plan)
    with pytest.raises(ValueError, match="not contiguous"):
        tree_broadcast([torch.zeros(4, 4).t()] * 3, plan)
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        tree_broadcast([torch.zeros(4), NOT_A_TENSOR, torch.zeros(4)], plan)
    with pytest.raises(ValueError, match="chunk_bytes"):
        tree_allreduce([torch.zeros(4)] * 3, plan, chunk_bytes=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_allreduce_on_cuda_devices() -> None:
    n = torch.cuda.device_count()
    plan = pack_trees(Topology.pcie_box(n), 0)
    xs = [torch.arange(1001, device=f"cuda:{i}", dtype=torch.float32) for i in range(n)]
    tree_allreduce(xs, plan, chunk_bytes=512)
    for i in range(n):
        torch.cuda.synchronize(i)
    for x in xs:
        assert torch.equal(x.cpu(), torch.arange(1001, dtype=torch.float32) * n)


def test_timer_matches_the_rate_when_the_pipeline_is_long() -> None:
    plan = plans()["dgx1v-8-ilp"]
    nbytes = 256 << 20
    ideal = nbytes / (plan.rate * 1e9)
    t = simulate(plan, nbytes, chunk_bytes=256 << 10, step_latency_s=0.0)
    assert ideal * (1 - 1e-9) <= t <= ideal * 1.1
    assert simulate(plan, nbytes, "allreduce", chunk_bytes=256 << 10) > t
    assert simulate(plan, 0) == 0.0
    with pytest.raises(ValueError, match="op must be"):
        simulate(plan, 10, UNKNOWN_OP)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(plans())), nbytes=st.integers(1, 1 << 24),
       chunk_bytes=st.integers(1 << 10, 1 << 22))
def test_timer_never_beats_the_plan_rate(name: str, nbytes: int, chunk_bytes: int) -> None:
    plan = plans()[name]
    t = simulate(plan, nbytes, chunk_bytes=chunk_bytes, step_latency_s=0.0)
    assert t >= nbytes / (plan.rate * 1e9) * (1 - 1e-9)


def test_timer_prefers_trees_where_rings_cross_pcie() -> None:
    topo = Topology.dgx1v().subgraph([0, 1, 2, 3, 4])
    trees, rings = pack_trees(topo, 0), ring_plan(topo, 0)
    nbytes = 64 << 20
    assert simulate(trees, nbytes) * 2 < simulate(rings, nbytes)
