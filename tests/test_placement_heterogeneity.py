"""Simulated heterogeneity: the anchor's slowdown ranges, seeding, applying them to a cluster,
and a real CPU run made slower by a factor."""

from __future__ import annotations

import os
import time

import pytest
import torch

from salus.daemon.services.placement import (
    DeviceProfile,
    DeviceSlowdown,
    compute_slowdown,
    draw_slowdowns,
    heterogeneous_cluster,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
BASE = DeviceProfile("gpu", 1e13, 1e12, 16 * 2**30)


def test_draws_follow_the_anchor_ranges_and_the_seed() -> None:
    draws = draw_slowdowns(2000, seed=7)
    for field, hi in (("compute", 2.0), ("memory", 3.0), ("network", 2.0)):
        values = [getattr(s, field) for s in draws]
        assert min(values) >= 1.0 and max(values) < hi
        assert sum(values) / len(values) == pytest.approx((1.0 + hi) / 2, rel=0.05)
    assert draw_slowdowns(5, seed=7) == draws[:5]
    assert draw_slowdowns(5, seed=8) != draws[:5]


def test_slowdown_factors_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="memory"):
        DeviceSlowdown(1.5, 0.5, 1.0)


def test_heterogeneous_cluster_applies_each_device_factors() -> None:
    cluster = heterogeneous_cluster(BASE, 3, latency_s=1e-5, bandwidth_bytes_per_s=1e10, seed=3)
    draws = draw_slowdowns(3, seed=3)
    for dev, s in zip(cluster.devices, draws, strict=True):
        assert dev.flops_per_s == pytest.approx(BASE.flops_per_s / s.compute)
        assert dev.bytes_per_s == pytest.approx(BASE.bytes_per_s / s.compute)
        assert dev.memory_bytes == int(BASE.memory_bytes / s.memory)
    slower = max(draws[0].network, draws[2].network)
    assert cluster.links.bandwidth_bytes_per_s[0][2] == pytest.approx(1e10 / slower)
    assert cluster.links.latency_s[2][0] == pytest.approx(1e-5 * slower)
    assert [d.name for d in cluster.devices] == ["gpu0", "gpu1", "gpu2"]


def test_compute_slowdown_sleeps_the_missing_time() -> None:
    ticks = iter([10.0, 10.5])
    slept: list[float] = []
    with compute_slowdown(3.0, clock=lambda: next(ticks), sleep=slept.append):
        pass
    assert slept == [pytest.approx(1.0)]


def _work() -> None:
    a = torch.randn(256, 256)
    for _ in range(40):
        a = torch.tanh(a @ a)


def test_compute_slowdown_slows_a_real_cpu_run() -> None:
    torch.set_num_threads(1)
    _work()
    base, slowed = [], []
    for _ in range(3):
        start = time.perf_counter()
        _work()
        base.append(time.perf_counter() - start)
        start = time.perf_counter()
        with compute_slowdown(2.0):
            _work()
        slowed.append(time.perf_counter() - start)
    assert 1.5 < min(slowed) / min(base) < 3.0
