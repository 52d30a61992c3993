"""Devices the daemon owns: every CUDA device when there are some, else `--cpu-devices` CPU devices.

A CPU device is a first-class backend: it gets a budget of `--cpu-memory` bytes and runs lanes
like a GPU does. Its default size is a quarter of the memory available at start, split across
the CPU devices and capped at 8 GiB each, so a laptop run never pushes the host into swap.

`--cpu-device-slowdown` simulates heterogeneous devices on one machine: CPU device i's
executors stretch their computation by a factor (`ComputeSlowdown`: they sleep (factor - 1) x
the CPU seconds of each call). It is a simulation, and says so wherever devices are shown.

A CUDA device is named by its UUID, never by an NVML index taken for a CUDA one (CUDA orders
devices fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`). Its budget is `SAFETY_FRACTION` of
its total memory less what other processes use at start. The daemon reads this through NVML;
without nvidia-ml-py, a throw-away subprocess asks `torch.cuda`, so the daemon's own process
never imports torch nor holds a CUDA context (`tests/test_daemon_imports.py`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_CPU_CAP_BYTES = 8 * 2**30
MAX_SLOWDOWN = 100.0
SAFETY_FRACTION = 0.9  # of what others leave on a GPU: room for the driver and fragmentation
PROBE_TIMEOUT_S = 120.0  # importing torch and starting CUDA on 8 GPUs takes tens of seconds

log = logging.getLogger("salusd.devices")
T = TypeVar("T")


def parse_size(text: str | int) -> int:
    """Bytes from '512M', '4G', '4GiB', '1.5g' or a plain integer (bytes)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}; use e.g. 512M, 4G or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: float) -> str:
    """'1.5 GiB' style text for people."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class DeviceSpec:
    """One device: its index in the daemon, torch device string and memory budget in bytes; a
    CUDA device also its UUID ("GPU-…") and total memory (bytes)."""

    index: int
    kind: Literal["cpu", "cuda"]
    torch_device: str
    name: str
    memory_bytes: int
    compute_slowdown: float = 1.0  # simulated (`--cpu-device-slowdown`); 1.0: none
    uuid: str | None = None
    total_bytes: int | None = None

    def describe(self) -> dict[str, object]:
        return {
            "index": self.index,
            "kind": self.kind,
            "torch_device": self.torch_device,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "compute_slowdown": self.compute_slowdown,
            "uuid": self.uuid,
            "total_bytes": self.total_bytes,
        }


def available_host_memory() -> int:
    """Bytes of host memory available now (MemAvailable), or 4 GiB if /proc is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def cpu_devices(count: int = 1, memory_bytes: int | None = None) -> list[DeviceSpec]:
    """`count` CPU devices of `memory_bytes` each (default: see module docstring)."""
    if count < 1:
        raise ValueError(f"--cpu-devices must be >= 1, got {count}")
    if memory_bytes is None:
        memory_bytes = min(_CPU_CAP_BYTES, available_host_memory() // (4 * count))
    if memory_bytes < 2**20:
        raise ValueError(f"--cpu-memory must be at least 1 MiB, got {memory_bytes} bytes")
    return [DeviceSpec(i, "cpu", "cpu", f"cpu{i}", memory_bytes) for i in range(count)]


def with_cpu_slowdown(devices: list[DeviceSpec], text: str) -> list[DeviceSpec]:
    """The CPU devices with `--cpu-device-slowdown` applied (ValueError says what is wrong).

    `seed=N` gives CPU device i the compute factor of `draw_slowdowns(len(devices), N)[i]`
    (U[1, 2), as Sky Computing's experiments drew them); `1,1.8` gives the factors, one per CPU
    device in index order, each from 1 (not slowed) to `MAX_SLOWDOWN`.
    """
    if any(d.kind != "cpu" for d in devices):
        raise ValueError("--cpu-device-slowdown simulates slow CPU devices; this daemon serves "
                         "CUDA devices (ask for --cpu-devices N to serve CPU devices)")
    text = text.strip()
    if text.startswith("seed="):
        from salus.daemon.services.slowdown import draw_slowdowns

        seed = text.removeprefix("seed=")
        if not seed.isdigit():
            raise ValueError(f"--cpu-device-slowdown seed=N wants a non-negative integer, got "
                             f"{seed!r}")
        factors = [s.compute for s in draw_slowdowns(len(devices), int(seed))]
    else:
        try:
            factors = [float(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"--cpu-device-slowdown wants seed=N or one factor per CPU device "
                             f"(e.g. 1,1.8), got {text!r}") from None
        if len(factors) != len(devices):
            raise ValueError(f"--cpu-device-slowdown gives {len(factors)} factor(s) for "
                             f"{len(devices)} CPU device(s)")
        bad = [f for f in factors if not 1.0 <= f <= MAX_SLOWDOWN]
        if bad:
            raise ValueError(f"--cpu-device-slowdown factors must be from 1 to {MAX_SLOWDOWN:g}, "
                             f"got {bad}")
    return [replace(d, compute_slowdown=f) for d, f in zip(devices, factors, strict=True)]


def cpu_threads_default(cpu_device_count: int) -> int:
    """Intra-op threads per torch op when serving CPU devices: half the cores per device, at
    least 1. Lanes run in parallel, so ops that each took every core would oversubscribe them
    (and OpenMP's spinning workers would waste what is left)."""
    return max(1, (os.cpu_count() or 1) // (2 * cpu_device_count))


def cuda_devices(fraction: float = SAFETY_FRACTION, nvml: Any | None = None) -> list[DeviceSpec]:
    """Every visible CUDA device, by UUID, with `fraction` of what others leave as its budget.

    Found with NVML (`nvml`: the nvidia-ml-py module, imported when None; then nothing in this
    process touches CUDA), else, where the NVIDIA driver's device node exists, by a throw-away
    `torch.cuda` probe in a subprocess (`probe_cuda_devices`): the daemon never imports torch."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {fraction}")
    nvml = nvml if nvml is not None else _import_nvml()
    if nvml is not None:
        found = nvml_devices(nvml, fraction, os.environ.get("CUDA_VISIBLE_DEVICES"),
                             os.environ.get("CUDA_DEVICE_ORDER"))
        if found is not None:
            return found
    if not os.path.exists("/dev/nvidiactl"):
        return []
    return probe_cuda_devices(fraction)


def _import_nvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def with_nvml(nvml: Any, call: Callable[[], T], without: T, instead: str,
              logger: logging.Logger | None = None) -> T:
    """`call()` with NVML started (`nvml`: the pynvml module or a stand-in), shut down after it
    whatever happens; `without` when NVML does not start (no driver), which `logger` (default:
    this module's) notes at info level with `instead`: what the caller does without it."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        (logger or log).info("NVML did not start (%s): %s", exc, instead)
        return without
    try:
        return call()
    finally:
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # bytes before 11.515


def visible_uuids(visible: str | None, uuids: list[str], *, pci_order: bool) -> list[str] | None:
    """The UUIDs CUDA shows, in its order, given `CUDA_VISIBLE_DEVICES` and NVML's `uuids`.

    UUIDs and unique prefixes of them are matched; an index is NVML's only with
    `CUDA_DEVICE_ORDER=PCI_BUS_ID` (CUDA otherwise orders fastest first). As CUDA does, the list
    ends at the first entry that names no device. None: an entry NVML cannot resolve (an index
    in CUDA's order, a MIG instance), which `torch.cuda` in a probe must answer."""
    if visible is None:
        return list(uuids)
    chosen: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            break
        if entry.isdigit():
            if not pci_order:
                return None
            found = [uuids[int(entry)]] if int(entry) < len(uuids) else []
        elif entry.startswith("GPU-"):
            found = [u for u in uuids if u.startswith(entry)]
        else:
            return None
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


def pinned_gpus(pin: str, gpus: list[str]) -> list[int]:
    """Which of the daemon's GPUs (`gpus`, by UUID in its order) a job's own
    `CUDA_VISIBLE_DEVICES=pin` names, as indices into `gpus`: an entry is an index into them
    (the job sees the daemon's GPUs, so its 0 is the daemon's first), a UUID or a unique UUID
    prefix. As CUDA does, the list ends at the first entry that names no GPU or one named
    already; an empty pin hides every GPU."""
    chosen: list[int] = []
    for entry in (e.strip() for e in pin.split(",")):
        if entry.isdigit():
            found = [int(entry)] if int(entry) < len(gpus) else []
        else:
            found = [i for i, g in enumerate(gpus) if entry and g.startswith(entry)]
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


def nvml_devices(nvml: Any, fraction: float, visible: str | None,
                 order: str | None) -> list[DeviceSpec] | None:
    """CUDA devices through NVML (`nvml`: the pynvml module or a stand-in with its functions),
    by UUID: device i is the i-th GPU that `CUDA_VISIBLE_DEVICES` (`visible`) shows. None when
    NVML does not start (no driver), fails on a GPU, or cannot resolve `visible` (see
    `visible_uuids`)."""

    def describe() -> list[DeviceSpec] | None:
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
            chosen = visible_uuids(visible, uuids, pci_order=order == "PCI_BUS_ID")
            if chosen is None:
                return None
            return [_nvml_spec(nvml, i, uuid, handles[uuids.index(uuid)], fraction)
                    for i, uuid in enumerate(chosen)]
        except nvml.NVMLError as exc:
            log.warning("NVML could not describe the GPUs (%s): asking torch.cuda instead", exc)
            return None

    return with_nvml(nvml, describe, None, "no CUDA devices through NVML")


def _nvml_spec(nvml: Any, index: int, uuid: str, handle: Any, fraction: float) -> DeviceSpec:
    name = _text(nvml.nvmlDeviceGetName(handle))
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        processes = []
    # usedGpuMemory is None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)
    ours = sum(p.usedGpuMemory or 0 for p in processes if p.pid == os.getpid())
    others = [p for p in processes if p.pid != os.getpid()]
    # NVML's v1 `used` is what processes allocated plus the driver's reserve: both are others'
    return _cuda_spec(index, uuid, name, int(memory.total), int(memory.used) - ours, fraction,
                      f"the driver and {len(others)} other process(es) visible to NVML")


def _cuda_spec(index: int, uuid: str, name: str, total: int, others: int, fraction: float,
               whose: str) -> DeviceSpec:
    budget = int(max(0, total - others) * fraction)
    log.info("cuda:%d is %s (%s): %s in all, %s in use at start by %s, budget %s "
             "(%.2f of the rest)", index, uuid, name, format_size(total), format_size(others),
             whose, format_size(budget), fraction)
    return DeviceSpec(index, "cuda", f"cuda:{index}", name, budget, uuid=uuid, total_bytes=total)


_PROBE = """
import json, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
found = []
for i in range(count):
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    found.append({"uuid": str(p.uuid), "name": p.name, "total_bytes": total, "free_bytes": free})
print(json.dumps({"count": count, "devices": found}))
"""


class CudaProbeError(ValueError):
    """The `torch.cuda` probe failed; the message says what to do (a ValueError, as every
    start-up problem the CLI reports in one line)."""


def probe_cuda_devices(fraction: float = SAFETY_FRACTION, timeout_s: float = PROBE_TIMEOUT_S,
                       run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                       ) -> list[DeviceSpec]:
    """CUDA devices as `torch.cuda` sees them, from a throw-away `python -c` subprocess, so the
    daemon never creates a context nor imports torch (`run`: `subprocess.run` or a stand-in).

    The probe's own contexts are counted as others' use, so the budget is low by about one
    context per device (300-700 MiB, docs: GPU-NOTES); nvidia-ml-py avoids that."""
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    advice = "install nvidia-ml-py, or serve CPU devices with --cpu-devices N"
    try:
        done = run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                   timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CudaProbeError(f"probing CUDA devices with torch took over {timeout_s:g} s; "
                             f"{advice}") from None
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        raise CudaProbeError(f"probing CUDA devices with torch failed (exit status "
                             f"{done.returncode}: {' / '.join(tail)}); {advice}")
    return parse_probe(done.stdout, fraction)


def parse_probe(stdout: str, fraction: float) -> list[DeviceSpec]:
    """The devices in the probe's output (its last line: JSON, see `_PROBE`)."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        devices = report["devices"]
        if report["count"] != len(devices):
            raise ValueError(f"count {report['count']} but {len(devices)} devices")
        return [_cuda_spec(i, _gpu_uuid(str(d["uuid"])), str(d["name"]), int(d["total_bytes"]),
                           int(d["total_bytes"]) - int(d["free_bytes"]), fraction,
                           "others and this probe's own context")
                for i, d in enumerate(devices)]
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise CudaProbeError(f"the torch.cuda probe printed what it should not "
                             f"({exc!r}): {stdout[-500:]!r}") from None


def _gpu_uuid(text: str) -> str:
    # torch prints the bare UUID; NVML and CUDA_VISIBLE_DEVICES name it "GPU-<uuid>"
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def discover(
    cpu_count: int | None = None, cpu_memory_bytes: int | None = None, *, use_cuda: bool = True,
    gpu_fraction: float = SAFETY_FRACTION,
) -> list[DeviceSpec]:
    """CUDA devices if present (and `use_cuda`; budgets: `gpu_fraction` of what others leave),
    else CPU devices.

    Asking for CPU devices explicitly (`cpu_count`) selects the CPU backend even on a GPU host."""
    if cpu_count is None and use_cuda:
        found = cuda_devices(gpu_fraction)
        if found:
            return found
    return cpu_devices(cpu_count or 1, cpu_memory_bytes)
