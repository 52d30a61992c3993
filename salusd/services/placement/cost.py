"""The cost model every allocator optimises: stage time and stage memory of contiguous layers.

Devices are taken in the cluster profile's order, which is the pipeline order: stage d runs on
device d and sends to device d + 1. For layers a..b-1 on device d:

- compute seconds: the sum over the layers of max(FLOPs / FLOP/s, bytes accessed / bytes/s)
  (a per-layer roofline, forward plus backward);
- link seconds (all but the last stage): the last layer's output goes to device d + 1 and its
  gradient, the same size, comes back: 2 · (latency + output bytes / bandwidth);
- memory bytes: the sum of the layers' `memory_bytes` (state and saved activations), which
  must not exceed the device's `memory_bytes`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .plan import Plan
from .profile import ClusterProfile, ModelProfile


class CostModel:
    """Stage costs of one model on one cluster, from prefix sums (each query is O(1))."""

    def __init__(self, model: ModelProfile, cluster: ClusterProfile) -> None:
        layers, devices = model.layers, cluster.devices
        if not layers or not devices:
            raise ValueError("a placement needs at least one layer and one device")
        self.num_layers = len(layers)
        self.num_devices = len(devices)
        slow = [d.name for d in devices if not (d.flops_per_s > 0 and d.bytes_per_s > 0)]
        unlinked = [d for d in range(len(devices) - 1)
                    if not cluster.links.bandwidth_bytes_per_s[d][d + 1] > 0]
        if slow or unlinked:
            raise ValueError(f"devices {slow} need positive FLOP/s and bytes/s, and links "
                             f"{[(d, d + 1) for d in unlinked]} positive bandwidth")
        flops = np.array([lay.flops for lay in layers], dtype=np.float64)
        traffic = np.array([lay.bytes_accessed for lay in layers], dtype=np.float64)
        speed = np.array([d.flops_per_s for d in devices], dtype=np.float64)
        bandwidth = np.array([d.bytes_per_s for d in devices], dtype=np.float64)
        #: layer_s[d, l]: compute seconds of layer l on device d.
        self.layer_s: npt.NDArray[np.float64] = np.maximum(
            flops[None, :] / speed[:, None], traffic[None, :] / bandwidth[:, None])
        #: compute_prefix_s[d, b]: compute seconds of layers 0..b-1 on device d.
        self.compute_prefix_s: npt.NDArray[np.float64] = np.concatenate(
            [np.zeros((self.num_devices, 1)), np.cumsum(self.layer_s, axis=1)], axis=1)
        out = np.array([lay.output_bytes for lay in layers], dtype=np.float64)
        #: link_s[d, l]: link seconds when stage d ends at layer l (zero for the last stage).
        self.link_s: npt.NDArray[np.float64] = np.zeros((self.num_devices, self.num_layers))
        for d in range(self.num_devices - 1):
            lat = cluster.links.latency_s[d][d + 1]
            bw = cluster.links.bandwidth_bytes_per_s[d][d + 1]
            self.link_s[d] = 2 * (lat + out / bw)
        #: layer_bytes[l] and capacity_bytes[d]: memory needed and granted.
        self.layer_bytes: npt.NDArray[np.int64] = np.array(
            [lay.memory_bytes for lay in layers], dtype=np.int64)
        #: memory_prefix_bytes[b]: bytes of layers 0..b-1.
        self.memory_prefix_bytes: npt.NDArray[np.int64] = np.concatenate(
            [[0], np.cumsum(self.layer_bytes)]).astype(np.int64)
        self.capacity_bytes: npt.NDArray[np.int64] = np.array(
            [d.memory_bytes for d in devices], dtype=np.int64)

    def stage_time_s(self, d: int, a: int, b: int) -> float:
        """Seconds of stage d holding layers a..b-1, a < b (compute plus link to d + 1)."""
        prefix = self.compute_prefix_s[d]
        return float(prefix[b] - prefix[a] + self.link_s[d, b - 1])

    def stage_memory_bytes(self, a: int, b: int) -> int:
        """Bytes layers a..b-1 need on whichever device holds them."""
        return int(self.memory_prefix_bytes[b] - self.memory_prefix_bytes[a])

    def fits(self, d: int, a: int, b: int) -> bool:
        """Whether layers a..b-1 fit device d's memory."""
        return self.stage_memory_bytes(a, b) <= self.capacity_bytes[d]

    def max_ends(self, d: int) -> npt.NDArray[np.int64]:
        """For each start a in 0..L, the largest b such that layers a..b-1 fit device d."""
        limit = self.memory_prefix_bytes + self.capacity_bytes[d]
        return np.searchsorted(self.memory_prefix_bytes, limit, side="right").astype(np.int64) - 1

    def plan(self, allocator: str, boundaries: tuple[int, ...], planning_s: float, status: str,
             mip_gap: float | None = None) -> Plan:
        """The plan of `boundaries`, checked: stages contiguous, non-empty, covering every
        layer once in order, each within its device's memory (ValueError otherwise)."""
        b = tuple(int(x) for x in boundaries)
        if len(b) != self.num_devices + 1 or b[0] != 0 or b[-1] != self.num_layers:
            raise ValueError(f"boundaries {b} must run from 0 to {self.num_layers} "
                             f"in {self.num_devices + 1} steps")
        if any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"boundaries {b} leave an empty or reversed stage")
        over = [d for d in range(self.num_devices) if not self.fits(d, b[d], b[d + 1])]
        if over:
            raise ValueError(f"stages {over} of {b} exceed their devices' memory")
        times = tuple(self.stage_time_s(d, b[d], b[d + 1]) for d in range(self.num_devices))
        memory = tuple(self.stage_memory_bytes(b[d], b[d + 1]) for d in range(self.num_devices))
        return Plan(allocator, b, times, memory, planning_s, status, mip_gap)
