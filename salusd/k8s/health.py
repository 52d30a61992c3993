"""A GPU's health as the device plugin reports it: its device node is there, NVML still answers
for it, and it has sent no critical Xid.

NVML reports the driver's critical errors as events (`nvmlDeviceRegisterEvents` with
`nvmlEventTypeXidCriticalError`, read with `nvmlEventSetWait_v2`; each event names its GPU and
its Xid). Xids that an application causes (13 graphics engine exception, 31 memory page fault,
43 GPU stopped processing, 45 preemptive cleanup, 68 video processor exception, 109 context
switch timeout) leave the GPU healthy, as NVIDIA's own device plugin decides; any other
critical Xid makes it Unhealthy until salusd restarts (a GPU that reported one wants a reset or
a drain, which is the operator's call), and so does a GPU NVML can no longer find (fallen off
the bus). The kubelet then stops placing pods on its units.

A GPU that cannot register for the events (an old board: `NotSupported`) is watched by its node
and NVML only, with a warning. Without NVML (no `nvidia-ml-py`, or no driver) the device node
alone says, as before. `SALUS_IGNORE_XIDS` (comma-separated) adds Xids to leave healthy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from salus.daemon.devices.discovery import _text
from salus.daemon.k8s.units import GpuShare

log = logging.getLogger("salusd.k8s")

XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def ignored_xids(environ: Mapping[str, str] = os.environ) -> frozenset[int]:
    """The application Xids, and those `SALUS_IGNORE_XIDS` names (others in it are warned of)."""
    extra = set()
    for part in environ.get("SALUS_IGNORE_XIDS", "").split(","):
        if part.strip().isdigit():
            extra.add(int(part))
        elif part.strip():
            log.warning("SALUS_IGNORE_XIDS: %r is no Xid number; ignored", part)
    return APPLICATION_XIDS | extra


class XidHealth:
    """The health check by GPU uuid over NVML (`nvml`: the pynvml module or a stand-in), which
    it starts and keeps started until `close`. `present(uuid)`: the device node check."""

    def __init__(self, gpus: Sequence[GpuShare], nvml: Any, present: Callable[[str], bool],
                 ignored: frozenset[int] = APPLICATION_XIDS) -> None:
        self.nvml = nvml
        self.present = present
        self.ignored = ignored
        self.failed: dict[str, str] = {}  # uuid -> why it is unhealthy for good
        self.uuids = {g.uuid for g in gpus}
        nvml.nvmlInit()
        try:
            self.events = nvml.nvmlEventSetCreate()
        except BaseException:
            nvml.nvmlShutdown()
            raise
        for uuid in sorted(self.uuids):
            self._register(uuid)

    def _register(self, uuid: str) -> None:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not supported & XID_CRITICAL:
                log.warning("%s reports no Xid events: its health is its device node and "
                            "NVML's answer only", uuid)
                return
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL, self.events)
        except nvml.NVMLError as exc:
            log.warning("%s: no Xid events from NVML (%s): its health is its device node and "
                        "NVML's answer only", uuid, exc)

    def __call__(self, uuid: str) -> bool:
        self._take_events()
        if uuid in self.failed or not self.present(uuid):
            return False
        try:
            self.nvml.nvmlDeviceGetHandleByUUID(uuid)
        except self.nvml.NVMLError as exc:
            self._fail(uuid, f"NVML no longer finds it ({exc})")
            return False
        return True

    def _take_events(self) -> None:
        """Read every event waiting (none: NVML's timeout error at once)."""
        nvml = self.nvml
        while self.events is not None:
            try:
                event = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError_Timeout:
                return
            if not int(event.eventType) & XID_CRITICAL:
                continue
            xid = int(event.eventData)
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(event.device))
            except nvml.NVMLError as exc:
                log.warning("critical Xid %d from a GPU NVML cannot name (%s)", xid, exc)
                continue
            if xid in self.ignored:
                log.info("%s: Xid %d (an application's error): still healthy", uuid, xid)
            elif uuid in self.uuids:
                self._fail(uuid, f"critical Xid {xid}")

    def _fail(self, uuid: str, why: str) -> None:
        if uuid not in self.failed:
            self.failed[uuid] = why
            log.error("%s is unhealthy until salusd restarts: %s", uuid, why)

    def close(self) -> None:
        """Free the event set and let NVML go (once; later calls do nothing)."""
        events, self.events = self.events, None
        if events is None:
            return
        try:
            self.nvml.nvmlEventSetFree(events)
        finally:
            self.nvml.nvmlShutdown()


def gpu_health(gpus: Sequence[GpuShare], nvml: Any | None,
               present: Callable[[str], bool]) -> Callable[[str], bool]:
    """`XidHealth` where NVML starts, else `present` alone (said once in the log)."""
    if nvml is None:
        log.info("no NVML (nvidia-ml-py): a GPU's health is its device node")
        return present
    try:
        return XidHealth(gpus, nvml, present, ignored_xids())
    except nvml.NVMLError as exc:
        log.info("NVML did not start (%s): a GPU's health is its device node", exc)
        return present
