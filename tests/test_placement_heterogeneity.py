"""Simulated heterogeneity: the anchor's slowdown ranges, seeding, applying them to a cluster
(checked against factors picked by hand and against the seeded draws made with numpy alone),
a real CPU run made slower by a factor, and the daemon's `--cpu-device-slowdown`."""

from __future__ import annotations

import os
import time

import numpy as np
import numpy.typing as npt
import pytest
import torch

from salus.daemon.devices.discovery import DeviceSpec, cpu_devices, with_cpu_slowdown
from salus.daemon.services.placement import (
    ClusterProfile,
    DeviceProfile,
    DeviceSlowdown,
    LinkProfile,
    compute_slowdown,
    draw_slowdowns,
    heterogeneous_cluster,
    slow_down,
)
from salus.daemon.services.slowdown import ComputeSlowdown

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


def _anchor_draws(num_devices: int, seed: int) -> npt.NDArray[np.float64]:
    """The anchor's seeded factors made here with numpy alone: per device one row of three
    U[0, 1) from `default_rng(seed)`, scaled to compute U[1, 2), memory U[1, 3), network
    U[1, 2)."""
    u = np.random.default_rng(seed).random((num_devices, 3))
    return 1.0 + u * np.array([1.0, 2.0, 1.0])


def test_slow_down_applies_hand_picked_factors() -> None:
    links = LinkProfile(((0.0, 1e-5, 1e-5), (1e-5, 0.0, 1e-5), (1e-5, 1e-5, 0.0)),
                        ((0.0, 1e10, 1e10), (1e10, 0.0, 1e10), (1e10, 1e10, 0.0)))
    cluster = ClusterProfile((BASE, BASE, BASE), links)
    slowed = slow_down(cluster, [DeviceSlowdown(2.0, 4.0, 1.0), DeviceSlowdown(1.0, 1.0, 1.25),
                                 DeviceSlowdown(1.6, 2.0, 2.0)])
    # 1e13 FLOP/s and 1e12 B/s divided by the compute factor; 16 GiB by the memory factor.
    assert [d.flops_per_s for d in slowed.devices] == pytest.approx([5e12, 1e13, 6.25e12])
    assert [d.bytes_per_s for d in slowed.devices] == pytest.approx([5e11, 1e12, 6.25e11])
    assert [d.memory_bytes for d in slowed.devices] == [4 * 2**30, 16 * 2**30, 8 * 2**30]
    # A link takes its slower end's network factor: 0-1 x1.25, 0-2 and 1-2 x2.
    np.testing.assert_allclose(slowed.links.latency_s, [[0.0, 1.25e-5, 2e-5],
                                                        [1.25e-5, 0.0, 2e-5],
                                                        [2e-5, 2e-5, 0.0]], rtol=1e-12)
    np.testing.assert_allclose(slowed.links.bandwidth_bytes_per_s, [[0.0, 8e9, 5e9],
                                                                    [8e9, 0.0, 5e9],
                                                                    [5e9, 5e9, 0.0]], rtol=1e-12)


def test_heterogeneous_cluster_applies_each_device_factors() -> None:
    cluster = heterogeneous_cluster(BASE, 3, latency_s=1e-5, bandwidth_bytes_per_s=1e10, seed=3)
    draws = _anchor_draws(3, seed=3)
    for dev, (compute, memory, _) in zip(cluster.devices, draws, strict=True):
        assert dev.flops_per_s == pytest.approx(BASE.flops_per_s / compute)
        assert dev.bytes_per_s == pytest.approx(BASE.bytes_per_s / compute)
        assert dev.memory_bytes == int(BASE.memory_bytes / memory)
    for i in range(3):
        for j in range(3):
            slower = max(draws[i][2], draws[j][2])
            assert cluster.links.latency_s[i][j] == pytest.approx(
                0.0 if i == j else 1e-5 * slower)
            assert cluster.links.bandwidth_bytes_per_s[i][j] == pytest.approx(
                0.0 if i == j else 1e10 / slower)
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
    """The block takes twice its own computation: measured around the same computation, so
    other load on the machine (which slows one run and not another) cannot decide it."""
    torch.set_num_threads(1)
    _work()
    ratios = []
    for _ in range(3):
        start = time.perf_counter()
        with compute_slowdown(2.0):
            inner = time.perf_counter()
            _work()
            inner = time.perf_counter() - inner
        ratios.append((time.perf_counter() - start) / inner)
    assert 1.9 < min(ratios) < 2.5, ratios


def test_compute_slowdown_stretches_computation_not_waiting() -> None:
    slept: list[float] = []
    slow = ComputeSlowdown(3.0, sleep=slept.append)  # clock: this thread's CPU seconds
    with slow:
        time.sleep(0.2)  # blocked, as in a wait for a peer's message: not stretched
    with slow:
        _work()
    assert slept[0] < 0.02 and slept[1] > 0.01
    slow.factor = 1.0
    with slow:
        _work()
    assert len(slept) == 2


def test_cpu_device_slowdown_option() -> None:
    devices = cpu_devices(3, 2**30)
    seeded = with_cpu_slowdown(devices, "seed=4")
    assert [d.compute_slowdown for d in seeded] == pytest.approx(_anchor_draws(3, seed=4)[:, 0])
    given = with_cpu_slowdown(devices, "1, 1.8,2")
    assert [d.compute_slowdown for d in given] == [1.0, 1.8, 2.0]
    assert given[1].describe()["compute_slowdown"] == 1.8
    for bad, reason in (("1,2", "2 factor"), ("1,0.5,1", "from 1 to"), ("1,nan,1", "from 1"),
                        ("fast", "seed=N or one factor"), ("seed=x", "non-negative integer")):
        with pytest.raises(ValueError, match=reason):
            with_cpu_slowdown(devices, bad)
    gpu = [DeviceSpec(0, "cuda", "cuda:0", "gpu", 2**30)]
    with pytest.raises(ValueError, match="CPU devices"):
        with_cpu_slowdown(gpu, "2")


def test_cpu_ranks_of_one_node_share_their_best_measurement() -> None:
    from salus.daemon.services.placement.group_plan import _one_cpu

    busy = DeviceProfile("rank0", 2e9, 1e9, 2**30)  # benchmarked beside other load
    quiet = DeviceProfile("rank1", 5e9, 3e9, 2**29)
    shared = _one_cpu((busy, quiet))
    assert [(d.name, d.flops_per_s, d.bytes_per_s, d.memory_bytes) for d in shared] == [
        ("rank0", 5e9, 3e9, 2**30), ("rank1", 5e9, 3e9, 2**29)]
    slowed = slow_down(ClusterProfile(shared, LinkProfile(((0.0, 1e-5), (1e-5, 0.0)),
                                                          ((0.0, 1e9), (1e9, 0.0)))),
                       [DeviceSlowdown(1.0, 1.0, 1.0), DeviceSlowdown(3.0, 1.0, 1.0)])
    assert slowed.devices[0].flops_per_s == 3 * slowed.devices[1].flops_per_s
