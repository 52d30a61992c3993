"""The functions the kit's jobs run inside salusd's executors (shipped by value). salusd
synchronises the job's device at the end of every call, so a call's time is GPU time; the
functions also end with `torch.cuda.synchronize()` on CUDA, which then costs nothing more and
keeps their times comparable to the direct baselines'."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn


def device_of(s: Any) -> torch.device:
    return next(s.model.parameters()).device


def settle(device: torch.device) -> None:
    """Wait for the device's queued kernels (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(s: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """One SGD step on mean-squared error; the loss."""
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    settle(device_of(s))
    return float(loss.detach())


def infer(s: Any, x: torch.Tensor) -> float:
    """One forward pass; the output's mean (a scalar, so the reply is small)."""
    with torch.inference_mode():
        out = s.model(x).mean()
    settle(device_of(s))
    return float(out)


def train_emptying(s: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """`train`, then empty the caching allocator's cache, as a switch that hands the cache back
    would: the next call allocates its whole working set again (no-op on the CPU)."""
    loss = train(s, x, y)
    if device_of(s).type == "cuda":
        torch.cuda.empty_cache()
    return loss


def memory_stats(s: Any) -> dict[str, Any]:
    """This executor's `torch.cuda.memory_stats()` on the job's device (the all-pools current
    and peak counters, the allocation and cudaMalloc counts, bytes) and its reserved peak; on
    the CPU, why there are none."""
    device = device_of(s)
    if device.type != "cuda":
        return {"skipped": "a CPU device has no CUDA caching allocator"}
    stats = torch.cuda.memory_stats(device)
    kept = {k: v for k, v in stats.items()
            if k.endswith((".all.current", ".all.peak")) or k.startswith("num_")}
    return {"memory_stats": kept, "max_memory_reserved_bytes":
            torch.cuda.max_memory_reserved(device), "pid": os.getpid()}


def one_replica_join(s: Any) -> dict[str, Any]:
    """Join a 1-replica process group on the job's placed device, as a gang's replica does
    after placement (`salus.daemon.executor.gang.join`: NCCL on CUDA, gloo on the CPU),
    all_reduce a tensor of ones over it, and leave the group; what happened."""
    import torch.distributed as dist

    from salus.daemon.executor.gang import GangSpec, backend_for, join
    from salus.daemon.wire.address import free_port

    device = device_of(s)
    if dist.is_initialized():
        return {"joined": False, "error": "this executor is already in a process group"}
    start = time.perf_counter()
    try:
        comm = join(GangSpec(rank=0, world=1, port=free_port()), device)
        joined = time.perf_counter() - start
        t = torch.ones(1 << 20, device=device)
        comm.all_reduce(t)
        settle(device)
        ok = bool((t == 1).all())
    except Exception as exc:  # noqa: BLE001 - the failure is what gets reported
        return {"joined": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"joined": True, "backend": backend_for(device), "device": str(device),
            "join_s": joined, "all_reduce_ok": ok}


def allocate(s: Any, nbytes: int) -> int:
    """Allocate and touch `nbytes` on the job's device; the bytes allocated."""
    block = torch.ones(nbytes // 4, dtype=torch.float32, device=device_of(s))
    settle(block.device)
    return int(block.numel() * 4)


def illegal_access(s: Any) -> str:
    """Write far out of bounds on the job's CUDA device: a cupy kernel that writes 1 TiB past a
    small buffer (an illegal-address fault), else torch indexing a tensor out of range with
    kernel launches blocking (a device-side assert). Both poison this process's CUDA context."""
    device = device_of(s)
    try:
        import cupy
    except ImportError:
        x = torch.zeros(16, device=device)
        x[torch.tensor([1 << 40], device=device)] = 1.0
        settle(device)
        return "torch index out of range"
    kernel = cupy.RawKernel(
        'extern "C" __global__ void oob(float* p) { p[(1ull << 38) + threadIdx.x] = 1.0f; }',
        "oob")
    with cupy.cuda.Device(device.index or 0):
        buf = cupy.zeros(16, dtype=cupy.float32)
        kernel((1,), (32,), (buf,))
        cupy.cuda.runtime.deviceSynchronize()
    return "cupy kernel wrote out of bounds"


def segfault(s: Any) -> None:
    """Crash this executor with SIGSEGV (a null read), the CPU's analogue of a fatal fault."""
    import ctypes

    ctypes.string_at(0)


def gang_train(s: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """One replica's SGD step on its part of the batch, gradients averaged over the gang by
    `s.comm` (ring all-reduce): equal to one step on the whole batch."""
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.comm.all_reduce_gradients(s.model, algorithm="ring")
    s.opt.step()
    settle(device_of(s))
    return float(loss.detach())
