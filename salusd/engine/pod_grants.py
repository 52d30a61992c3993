"""What each Kubernetes pod may book: its allocation's units of `salusd.io/gpu-mem` (GiB), on
the device that holds them.

The device plugin (`salusd/k8s/`) tells the engine of every live allocation; admission asks
`refusal` before it submits a pod's job, or grows its lane, and a job that would take the
pod's jobs past the grant fails at once with the grant in its reason, rather than wait for
memory its pod was never promised. What counts is what the scheduler books for each live
job of the allocation: its persistent bytes plus its ephemeral (lane) request, both aligned
as the ledger places them (a lane shared with the pod's own larger job is not counted twice).

Pure bookkeeping, used on the daemon's loop thread only (the plugin's threads hand their
changes over with `Loop.call_soon_threadsafe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from salus.daemon.devices.discovery import format_size
from salus.daemon.engine.registry import JobRecord

UNIT_BYTES = 2**30  # one unit of salusd.io/gpu-mem (as salusd/k8s/units.py advertises it)


@dataclass(frozen=True)
class PodGrant:
    """A live allocation: its id, its units (GiB), the daemon device index of its GPU, and
    its pod ("namespace/name") once the kubelet's PodResources API has named it."""

    allocation: str
    units: int
    device: int
    pod: str | None = None

    @property
    def limit_bytes(self) -> int:
        return self.units * UNIT_BYTES

    @property
    def owner_name(self) -> str:
        """How the pod's jobs' owner is shown: `pod:<namespace>/<name>`, else
        `alloc:<id>` while no pod is named."""
        return f"pod:{self.pod}" if self.pod else f"alloc:{self.allocation}"


class PodGrants:
    """The live allocations, by id."""

    def __init__(self) -> None:
        self._grants: dict[str, PodGrant] = {}

    def set(self, grant: PodGrant) -> None:
        self._grants[grant.allocation] = grant

    def name_pod(self, allocation: str, pod: str) -> None:
        grant = self._grants.get(allocation)
        if grant is not None:
            self._grants[allocation] = replace(grant, pod=pod)

    def drop(self, allocation: str) -> PodGrant | None:
        return self._grants.pop(allocation, None)

    def get(self, allocation: str | None) -> PodGrant | None:
        return None if allocation is None else self._grants.get(allocation)

    def device(self, allocation: str | None) -> int | None:
        """The device the allocation's jobs are placed on (None: not a live allocation's)."""
        grant = self.get(allocation)
        return None if grant is None else grant.device

    def refusal(self, record: JobRecord, need_bytes: int,
                booked: Iterable[tuple[JobRecord, int]]) -> str | None:
        """Why `record` (a pod's job, needing `need_bytes` booked: persistent plus lane) may
        not be admitted, or None when it may (or is no pod's job). `booked`: every live job
        with the bytes the scheduler books for it now (the job itself is skipped)."""
        allocation = record.owner.allocation
        if allocation is None:
            return None
        grant = self._grants.get(allocation)
        if grant is None:
            return (f"job {record.job_id}: the pod's allocation {allocation} was freed "
                    "(its pod is gone)")
        others = sum(b for r, b in booked
                     if r.owner.allocation == allocation and r.job_id != record.job_id)
        if others + need_bytes <= grant.limit_bytes:
            return None
        besides = (f", and its other jobs book {format_size(others)}" if others else "")
        return (f"job {record.job_id} does not fit its pod's grant: the pod's grant is "
                f"{grant.units} GiB{besides}; this job needs {format_size(need_bytes)} "
                f"(salusd.io/gpu-mem in the pod's limits: ask for more, or make the job "
                "smaller)")
