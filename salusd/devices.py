"""Devices the daemon owns: every CUDA device when there are some, else `--cpu-devices` CPU devices.

A CPU device is a first-class backend: it gets a budget of `--cpu-memory` bytes and runs lanes
like a GPU does. Its default size is a quarter of the memory available at start, split across
the CPU devices and capped at 8 GiB each, so a laptop run never pushes the host into swap.

`--cpu-device-slowdown` simulates heterogeneous devices on one machine: CPU device i's
executors stretch their computation by a factor (`ComputeSlowdown`: they sleep (factor - 1) x
the CPU seconds of each call). It is a simulation, and says so wherever devices are shown.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Literal

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_CPU_CAP_BYTES = 8 * 2**30
MAX_SLOWDOWN = 100.0


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
    """One device: its index in the daemon, torch device string and memory budget in bytes."""

    index: int
    kind: Literal["cpu", "cuda"]
    torch_device: str
    name: str
    memory_bytes: int
    compute_slowdown: float = 1.0  # simulated (`--cpu-device-slowdown`); 1.0: none

    def describe(self) -> dict[str, object]:
        return {
            "index": self.index,
            "kind": self.kind,
            "torch_device": self.torch_device,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "compute_slowdown": self.compute_slowdown,
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


def cuda_devices(memory_fraction: float = 0.9) -> list[DeviceSpec]:
    """Every visible CUDA device with `memory_fraction` of its free memory as the budget.

    Found with nvidia-ml-py when it is installed (the daemon then never imports torch), else with
    torch.cuda where the NVIDIA driver's device node exists."""
    found = _nvml_devices(memory_fraction)
    if found is not None:
        return found
    if not os.path.exists("/dev/nvidiactl"):
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    specs = []
    for i in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(i)
        specs.append(DeviceSpec(i, "cuda", f"cuda:{i}", torch.cuda.get_device_name(i),
                                int(free * memory_fraction)))
    return specs


def _nvml_devices(memory_fraction: float) -> list[DeviceSpec] | None:
    """CUDA devices as NVML sees them (honouring CUDA_VISIBLE_DEVICES given as indices), or
    None when nvidia-ml-py or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = list(range(count))
    if visible is not None:
        try:
            indices = [int(v) for v in visible.split(",") if v.strip()]
        except ValueError:
            return None  # UUIDs: let torch resolve them
    specs = []
    for i, physical in enumerate(indices):
        handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
        name = pynvml.nvmlDeviceGetName(handle)
        free = pynvml.nvmlDeviceGetMemoryInfo(handle).free
        specs.append(DeviceSpec(i, "cuda", f"cuda:{i}",
                                name.decode() if isinstance(name, bytes) else str(name),
                                int(free * memory_fraction)))
    return specs


def discover(
    cpu_count: int | None = None, cpu_memory_bytes: int | None = None, *, use_cuda: bool = True
) -> list[DeviceSpec]:
    """CUDA devices if present (and `use_cuda`), else CPU devices.

    Asking for CPU devices explicitly (`cpu_count`) selects the CPU backend even on a GPU host."""
    if cpu_count is None and use_cuda:
        found = cuda_devices()
        if found:
            return found
    return cpu_devices(cpu_count or 1, cpu_memory_bytes)
