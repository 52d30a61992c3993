"""Simulated heterogeneity, as the Sky Computing experiments made it on a uniform cluster.

The anchor (hpcaitech/SkyComputing, `Stimulator`) gives each worker seeded random slowdowns:
compute time x U[1, 2), available memory / U[1, 3), network time x U[1, 2). `draw_slowdowns`
draws the same distributions (independently, from one seed); `slow_down` applies them to a
cluster profile; `heterogeneous_cluster` builds a seeded cluster from one base device and link.
`compute_slowdown` makes a real CPU run slower by a factor, so a small machine can show the
effect of a slow device on a real pipeline. The draws and the real slowdown live in
`salus.daemon.services.slowdown`, which the daemon itself imports (it never imports torch).
"""

from __future__ import annotations

from dataclasses import replace

from salus.daemon.services.slowdown import DeviceSlowdown, draw_slowdowns

from .profile import ClusterProfile, DeviceProfile, LinkProfile


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
