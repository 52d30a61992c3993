"""Simulated heterogeneity, as the Sky Computing experiments made it on a uniform cluster.

The anchor (hpcaitech/SkyComputing, `Stimulator`) gives each worker seeded random slowdowns:
compute time x U[1, 2), available memory / U[1, 3), network time x U[1, 2). `draw_slowdowns`
draws the same distributions (independently, from one seed); `slow_down` applies them to a
cluster profile; `heterogeneous_cluster` builds a seeded cluster from one base device and link.
`compute_slowdown` makes a real CPU run slower by a factor, so a small machine can show the
effect of a slow device on a real pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from .profile import ClusterProfile, DeviceProfile, LinkProfile


@dataclass(frozen=True)
class DeviceSlowdown:
    """Factors >= 1: compute time x `compute`, memory budget / `memory`, link time x `network`."""

    compute: float
    memory: float
    network: float

    def __post_init__(self) -> None:
        for field in ("compute", "memory", "network"):
            if not getattr(self, field) >= 1.0:
                raise ValueError(f"slowdown {field} must be a number >= 1, "
                                 f"got {getattr(self, field)}")


def draw_slowdowns(num_devices: int, seed: int) -> list[DeviceSlowdown]:
    """`num_devices` seeded slowdowns: compute U[1, 2), memory U[1, 3), network U[1, 2).

    Device i's factors do not depend on `num_devices`: a larger cluster of the same seed
    extends a smaller one.
    """
    u = np.random.default_rng(seed).random((num_devices, 3))
    return [DeviceSlowdown(1 + float(c), 1 + 2 * float(m), 1 + float(n)) for c, m, n in u]


def slow_down(cluster: ClusterProfile, slowdowns: list[DeviceSlowdown]) -> ClusterProfile:
    """The cluster with device i slowed by `slowdowns[i]`.

    Compute slows both achieved FLOP/s and bytes/s (every kernel takes longer); memory shrinks
    the budget; a link between i and j takes the slower end's network factor, on its latency
    and its bandwidth.
    """
    if len(slowdowns) != len(cluster.devices):
        raise ValueError(f"{len(slowdowns)} slowdowns for {len(cluster.devices)} devices")
    devices = tuple(
        replace(dev, flops_per_s=dev.flops_per_s / s.compute,
                bytes_per_s=dev.bytes_per_s / s.compute,
                memory_bytes=int(dev.memory_bytes / s.memory))
        for dev, s in zip(cluster.devices, slowdowns, strict=True)
    )
    n = len(devices)
    net = [[max(slowdowns[i].network, slowdowns[j].network) for j in range(n)] for i in range(n)]
    links = LinkProfile(
        tuple(tuple(cluster.links.latency_s[i][j] * net[i][j] for j in range(n))
              for i in range(n)),
        tuple(tuple(cluster.links.bandwidth_bytes_per_s[i][j] / net[i][j] for j in range(n))
              for i in range(n)),
    )
    return ClusterProfile(devices, links)


def heterogeneous_cluster(base: DeviceProfile, num_devices: int, latency_s: float,
                          bandwidth_bytes_per_s: float, seed: int) -> ClusterProfile:
    """`num_devices` copies of `base`, all linked by `latency_s` seconds and
    `bandwidth_bytes_per_s`, then slowed by `draw_slowdowns(num_devices, seed)`."""
    n = num_devices
    devices = tuple(replace(base, name=f"{base.name}{i}") for i in range(n))
    links = LinkProfile(
        tuple(tuple(0.0 if i == j else latency_s for j in range(n)) for i in range(n)),
        tuple(tuple(0.0 if i == j else bandwidth_bytes_per_s for j in range(n))
              for i in range(n)),
    )
    return slow_down(ClusterProfile(devices, links), draw_slowdowns(n, seed))


@contextmanager
def compute_slowdown(
    factor: float,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[None]:
    """Make the enclosed block take `factor` times its wall time: a simulation of a slower
    device, not a slower device. It runs the block, then sleeps (factor - 1) x its elapsed
    seconds; a block that raises is not slowed. The device is idle while it sleeps, so other
    processes sharing it are not slowed, which is what a separate slow device would give.
    """
    if not factor >= 1.0:
        raise ValueError(f"a slowdown factor must be >= 1, got {factor}")
    start = clock()
    yield
    sleep((factor - 1.0) * (clock() - start))
