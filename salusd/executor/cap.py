"""The executor process's device-memory cap: what all the jobs placed in it may reserve.

torch's caching allocator caps a process per device (`set_per_process_memory_fraction`),
checked against its reserved segments plus the one it is about to create. The jobs one
executor hosts share its allocator and run one call at a time, so the process may reserve their
persistent bytes plus one lane, the largest of theirs (`cap_bytes`). It is recomputed whenever
a job is placed (before that job's state moves in), leaves, swaps out, is handed over or ends.

Setting a cap starts CUDA in the process. An executor that runs a script must leave CUDA's
start to the script (a script that never touches the GPU must not pay for a context), so there
the cap is queued to be set as CUDA starts: `torch.cuda._lazy_call`, the hook torch's own
`manual_seed` uses for the same reason; it reads the cap as it stands then.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from salus.daemon.executor.on_import import imported, when_imported


def started_cuda() -> Any | None:
    """`torch.cuda` once torch started CUDA in this process, else None (always None before
    the script imports torch: this never imports it)."""
    torch = imported("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def cuda_started() -> bool:
    """Whether torch started CUDA in this process."""
    return started_cuda() is not None


@dataclass(frozen=True)
class Booking:
    """One job's place in this process: its torch `device` and its bytes there."""

    device: str
    persistent: int
    lane: int


def cap_bytes(bookings: list[Booking], device: str, workspace: int = 0) -> int:
    """The bytes the process may reserve on `device`: its jobs' persistent bytes there plus
    the largest of their lanes (they take turns in it), and its cuBLAS `workspace` once."""
    here = [b for b in bookings if b.device == device]
    if not here:
        return 0
    return sum(b.persistent for b in here) + max(b.lane for b in here) + workspace


class ProcessCap:
    """The jobs booked in this process, and the caps they imply on its CUDA devices."""

    def __init__(self) -> None:
        self.jobs: dict[int, Booking] = {}
        self.capped: set[str] = set()  # CUDA devices a cap was set on (a job left: lowered)
        self.workspace: dict[str, int] = {}  # the cuBLAS workspaces reserved per device
        self._queued = False

    def book(self, job: int, device: str, persistent: int, lane: int,
             workspace: int = 0) -> None:
        """Job `job` is placed on torch `device` with `persistent` and `lane` bytes; the
        process's cuBLAS `workspace` there is reserved once beside them."""
        self.jobs[job] = Booking(device, persistent, lane)
        self.workspace[device] = workspace
        self.apply()

    def drop(self, job: int) -> None:
        """Job `job` left the device (ended, swapped out, handed over)."""
        if self.jobs.pop(job, None) is not None:
            self.apply()

    def bytes_on(self, device: str) -> int:
        return cap_bytes(list(self.jobs.values()), device, self.workspace.get(device, 0))

    def devices(self) -> set[str]:
        """The CUDA devices whose cap this process sets: where jobs are, or were."""
        return self.capped | {b.device for b in self.jobs.values() if b.device.startswith("cuda")}

    def apply(self) -> None:
        """Set the caps now where CUDA has started, else when it starts (in a script that
        has not imported torch yet: once it does)."""
        if not self.devices() or self._queued:
            return
        torch = imported("torch")
        self._queued = True
        if torch is None:
            when_imported("torch", self._queue)
        else:
            self._queue(torch)

    def _queue(self, torch: ModuleType) -> None:
        if cuda_started():
            self._set(torch)
        else:
            torch.cuda._lazy_call(lambda: self._set(torch))

    def _set(self, torch: ModuleType) -> None:
        self._queued = False
        for device in self.devices():
            self.capped.add(device)
            target = torch.device(device)
            total = torch.cuda.get_device_properties(target).total_memory
            fraction = min(1.0, self.bytes_on(device) / total)
            torch.cuda.set_per_process_memory_fraction(fraction, target)
