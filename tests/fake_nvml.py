"""A stand-in for pynvml's event API (no GPU here): GPUs by uuid, each with the event types it
supports, and critical Xid events a test raises (`xid`), read back by `nvmlEventSetWait_v2` in
order, `NVMLError_Timeout` when none waits, as NVML does."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace


class FakeXidNvml:
    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, supported: dict[str, int]) -> None:
        self.supported = dict(supported)  # uuid -> event type mask
        self.lost: set[str] = set()  # uuids NVML no longer finds
        self.registered: dict[str, int] = {}
        self.queue: deque[SimpleNamespace] = deque()
        self.inits = self.shutdowns = self.freed = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.supported or uuid in self.lost:
            raise self.NVMLError("GPU is lost" if uuid in self.lost else "Not Found")
        return f"handle-{uuid}"

    def nvmlDeviceGetSupportedEventTypes(self, handle: str) -> int:
        return self.supported[handle.removeprefix("handle-")]

    def nvmlDeviceRegisterEvents(self, handle: str, mask: int, events: str) -> None:
        self.registered[handle.removeprefix("handle-")] = mask

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return handle.removeprefix("handle-")

    def xid(self, uuid: str, xid: int) -> None:
        """The driver reports critical Xid `xid` on `uuid` (delivered if it registered)."""
        if self.registered.get(uuid, 0) & 0x8:
            self.queue.append(SimpleNamespace(device=f"handle-{uuid}", eventType=0x8,
                                              eventData=xid))

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> SimpleNamespace:
        if not self.queue:
            raise self.NVMLError_Timeout("Timeout")
        return self.queue.popleft()

    def nvmlDeviceGetMinorNumber(self, handle: str) -> int:
        raise self.NVMLError("Not Supported")  # the plugin reads the driver's /proc files
