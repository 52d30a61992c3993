"""What the device plugin needs to know of a GPU beyond the daemon's device list: its device
node's minor number (/dev/nvidia<minor>) and whether it is still there.

The minor comes from NVML (`nvmlDeviceGetMinorNumber`) where nvidia-ml-py is installed, else
from the driver's /proc/driver/nvidia/gpus/<bus id>/information ("Device Minor:" and
"GPU UUID:" lines). Neither is read on a host without the NVIDIA driver: there the answer is
None, and `Allocate` grants no GPU node for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from salus.daemon.devices.discovery import DeviceSpec, _import_nvml, with_nvml
from salus.daemon.k8s.units import GpuShare

log = logging.getLogger("salusd.k8s")

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def minors_from_proc(root: Path = PROC_GPUS) -> dict[str, int]:
    """GPU uuid -> minor number from the driver's information files under `root`."""
    found: dict[str, int] = {}
    try:
        files = sorted(root.glob("*/information"))
    except OSError:
        return found
    for path in files:
        try:
            fields = dict(line.split(":", 1) for line in path.read_text().splitlines()
                          if ":" in line)
            found[fields["GPU UUID"].strip()] = int(fields["Device Minor"].strip())
        except (OSError, KeyError, ValueError) as exc:
            log.warning("cannot read a GPU's minor number from %s: %s", path, exc)
    return found


def minors_from_nvml(uuids: Sequence[str], nvml: Any) -> dict[str, int]:
    """GPU uuid -> minor number through NVML (`nvml`: the pynvml module or a stand-in); the
    GPUs NVML cannot answer for are left out."""

    def minors() -> dict[str, int]:
        found: dict[str, int] = {}
        for uuid in uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                found[uuid] = int(nvml.nvmlDeviceGetMinorNumber(handle))
            except nvml.NVMLError as exc:
                log.warning("NVML gives no minor number for %s: %s", uuid, exc)
        return found

    return with_nvml(nvml, minors, {}, "GPU minor numbers from /proc instead", log)


def shares(devices: Sequence[DeviceSpec], nvml: Any | None = None,
           proc: Path = PROC_GPUS) -> list[GpuShare]:
    """The daemon's CUDA devices as the plugin advertises them: each one's budget (bytes) and
    minor number (NVML first, then /proc; None where neither knows it). CPU devices are not
    GPUs: a host without CUDA devices has no shares."""
    gpus = [d for d in devices if d.kind == "cuda" and d.uuid]
    if not gpus:
        return []
    uuids = [d.uuid for d in gpus if d.uuid]
    nvml = nvml if nvml is not None else _import_nvml()
    minors = minors_from_nvml(uuids, nvml) if nvml is not None else {}
    if len(minors) < len(uuids):
        minors = {**minors_from_proc(proc), **minors}
    result = [GpuShare(u, d.memory_bytes, minors.get(u)) for d, u in zip(gpus, uuids,
                                                                             strict=True)]
    for share in result:
        if share.minor is None:
            log.warning("no device minor number for %s: Allocate will grant pods no "
                        "/dev/nvidia<minor> node for it", share.uuid)
    return result


def node_present(gpus: Sequence[GpuShare], dev: Path = Path("/dev")) -> Callable[[str], bool]:
    """A health check by GPU uuid: a GPU is healthy while its device node exists under `dev`
    (one whose minor is unknown, while /dev/nvidiactl does)."""
    nodes = {g.uuid: "nvidiactl" if g.minor is None else f"nvidia{g.minor}" for g in gpus}

    def healthy(uuid: str) -> bool:
        return uuid in nodes and (dev / nodes[uuid]).exists()
    return healthy
