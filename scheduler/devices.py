"""Admission's book of one node's devices: each device's bytes and lanes (`Device`), and the
devices in admission's order of preference (`LoadOrder`).

Admission places a job on the fitting device with the fewest admitted jobs, then the lowest
index. A pass over every device per admission costs O(devices), which dominated the trace
simulator at hundreds of devices (a million admissions x 512 devices). `LoadOrder` keeps the
devices grouped by their number of jobs, updated as jobs come and go, so admission walks them in
preference order and stops at the first that fits; usually that is one of the first few.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from salus.scheduler.mps import RunsAs

if TYPE_CHECKING:
    from salus.scheduler.lanes import Lane, LaneMode


class Device:
    """Per-device book-keeping: persistent bytes, lanes and their total size (bytes)."""

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.persistent = 0
        self.lanes: dict[int, Lane] = {}
        self.lane_bytes = 0
        self.jobs = 0
        self.owners: dict[RunsAs, int] = {}  # who its admitted jobs run as -> how many

    @property
    def unreserved(self) -> int:
        return self.capacity - self.persistent - self.lane_bytes

    def bounds(self, mode: LaneMode) -> tuple[int, int]:
        """Necessary conditions for one more job here: (max persistent bytes, max persistent +
        ephemeral bytes). Exact in single mode; in pack mode a job also needs a lane."""
        room = self.capacity - self.persistent
        if mode == "single":
            return room - self.lane_bytes, room
        free = room - self.lane_bytes
        return free, free + max((ln.size for ln in self.lanes.values()), default=0)


class LoadOrder:
    """`devices` in order of (admitted jobs, index). Call `moved` whenever a device's `jobs`
    changes; iterate to walk the devices in that order (do not change jobs meanwhile)."""

    def __init__(self, devices: Sequence[Device]) -> None:
        self._devices = devices
        # jobs -> indices of the devices with that many, ascending
        self._by_jobs: dict[int, list[int]] = {}
        for dev in devices:
            self._by_jobs.setdefault(dev.jobs, []).append(dev.index)

    def moved(self, dev: Device, before: int) -> None:
        """`dev` held `before` jobs and now holds `dev.jobs`."""
        bucket = self._by_jobs[before]
        del bucket[bisect.bisect_left(bucket, dev.index)]
        if not bucket:
            del self._by_jobs[before]
        joined = self._by_jobs.get(dev.jobs)
        if joined is None:
            self._by_jobs[dev.jobs] = [dev.index]
        else:
            bisect.insort(joined, dev.index)

    def __iter__(self) -> Iterator[Device]:
        devices = self._devices
        for jobs in sorted(self._by_jobs):
            for index in self._by_jobs[jobs]:
                yield devices[index]
