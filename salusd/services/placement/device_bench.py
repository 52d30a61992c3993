"""Device side of the benchmark phase: achieved FLOP/s and memory bytes/s of one device.

Two short kernels timed with `torch.utils.benchmark.Timer` (which synchronises CUDA and repeats
until a minimum run time): a square matmul (compute bound) and a tensor copy (memory bound).
The device's free memory is not measured here: the caller passes the daemon's budget for the
job, which is what a placement must respect.
"""

from __future__ import annotations

import torch
from torch.utils.benchmark import Timer

from .profile import DeviceProfile


def benchmark_device(
    device: torch.device | str,
    memory_bytes: int,
    *,
    name: str = "",
    matmul_size: int = 1024,
    copy_bytes: int = 64 * 2**20,
    min_run_time_s: float = 0.2,
    dtype: torch.dtype = torch.float32,
) -> DeviceProfile:
    """Measure `device` and return its profile with the granted `memory_bytes` (bytes).

    `flops_per_s` is 2·n³ FLOPs of an n×n matmul (n = `matmul_size`) over its fastest time;
    `bytes_per_s` is 2·`copy_bytes` (read and written) over the fastest time of a copy. The
    fastest of the timed blocks is the one least disturbed by other load on the machine (as in
    `benchmark_links`): the device's capacity, which a median under load would understate. Each
    kernel runs for at least `min_run_time_s` seconds, on all of this process's torch threads.
    `name` defaults to the device's string (e.g. "cpu", "cuda:0").
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
    dev = torch.device(device)
    n = matmul_size
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    matmul_s = _fastest_s("torch.mm(a, b, out=c)", {"a": a, "b": b, "c": c}, min_run_time_s)
    elems = max(1, copy_bytes // dtype.itemsize)
    src = torch.randn(elems, device=dev, dtype=dtype)
    dst = torch.empty_like(src)
    copy_s = _fastest_s("dst.copy_(src)", {"src": src, "dst": dst}, min_run_time_s)
    return DeviceProfile(
        name=name or str(dev),
        flops_per_s=2 * n**3 / matmul_s,
        bytes_per_s=2 * src.nbytes / copy_s,
        memory_bytes=memory_bytes,
    )


def _fastest_s(stmt: str, env: dict[str, torch.Tensor], min_run_time_s: float) -> float:
    timer = Timer(stmt, globals={"torch": torch, **env}, num_threads=torch.get_num_threads())
    return float(min(timer.blocked_autorange(min_run_time=min_run_time_s).times))
