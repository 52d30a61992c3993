"""What one more executor process costs a device, for the device's ledger.

On a GPU that is its CUDA context (and the cuBLAS handle a first matmul adds): device memory
outside torch's caching allocator, so `set_per_process_memory_fraction` never sees it (about
300-700 MiB by others' measurements, docs: GPU-NOTES). It is measured once per GPU at start in a
throw-away subprocess that sees only that GPU: NVML's used memory for that process minus torch's
reserved bytes. Beside it, the cuBLAS and cuBLASLt workspaces the process's first GEMMs take
*inside* the caching allocator (so not in the probe's figure): their reserved bytes follow from
the executors' ``CUBLAS_WORKSPACE_CONFIG``, which salusd sets where the caller did not
(`workspace_config`), and are booked once per process too (`ExecutorCost.workspace_bytes`).
On a CPU device it is the executor's private memory beside the zygote, measured by
`bench/executor_memory.py` (13.3-13.4 MiB in three runs on the 2-vCPU build VM, torch 2.13.0
CPU; booked as `CPU_EXECUTOR_BYTES`). The daemon never imports torch for either.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from salus.daemon.devices.discovery import DeviceSpec, format_size
from salus.daemon.memory.reserve import CUBLAS_WORKSPACE_CONFIG, blas_workspace_reserved

log = logging.getLogger("salusd.context_cost")

CPU_EXECUTOR_BYTES = 14 * 2**20  # bench/executor_memory.py: 13.3-13.4 MiB private, rounded up
GPU_CONTEXT_ESTIMATE_BYTES = 768 * 2**20  # above the 287-667 MB others measured; unmeasured here
MEASURE_TIMEOUT_S = 120.0

_MEASURE = """
import json, os, torch, pynvml
a = torch.ones(64, 64, device="cuda:0")
(a @ a).sum().item()
reserved = torch.cuda.memory_reserved(0)
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByUUID(os.environ["CUDA_VISIBLE_DEVICES"].encode())
used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if p.pid == os.getpid()]
print(json.dumps({"used": used[0] if used else None, "reserved": reserved}))
"""


@dataclass(frozen=True)
class ExecutorCost:
    """Bytes one more executor holds on a device, and how the figure was found; on a GPU
    `bytes` includes the `workspace_bytes` its cuBLAS(Lt) workspaces reserve in the caching
    allocator."""

    bytes: int
    measured: bool
    how: str
    workspace_bytes: int = 0


def workspace_config(environ: Mapping[str, str]) -> str:
    """The ``CUBLAS_WORKSPACE_CONFIG`` executors run with: the caller's (`environ`), else
    `reserve.CUBLAS_WORKSPACE_CONFIG`, so that the workspace's size does not depend on the
    GPU."""
    return environ.get("CUBLAS_WORKSPACE_CONFIG") or CUBLAS_WORKSPACE_CONFIG


def executor_cost(device: DeviceSpec, timeout_s: float = MEASURE_TIMEOUT_S,
                  run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                  environ: Mapping[str, str] = os.environ,
                  given: int | None = None) -> ExecutorCost:
    """What one more executor costs `device` (bytes): on a GPU its CUDA context, measured in a
    subprocess that sees only that GPU (`run`: `subprocess.run` or a stand-in), or the
    `GPU_CONTEXT_ESTIMATE_BYTES` estimate where that fails (no nvidia-ml-py, NVML that cannot
    see the process's pid inside a container), plus the reserved bytes of its cuBLAS(Lt)
    workspaces under the daemon's environment `environ`; on a CPU device
    `CPU_EXECUTOR_BYTES`. `given`: a GPU context's bytes measured before (`salusd serve
    --context-bytes`, which the GPU kit passes to every daemon it starts), not measured again."""
    if device.kind != "cuda" or device.uuid is None:
        return ExecutorCost(CPU_EXECUTOR_BYTES, False, "an executor's private memory beside "
                            "the zygote (bench/executor_memory.py)")
    env = {**environ, "CUDA_VISIBLE_DEVICES": device.uuid, "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
           "CUBLAS_WORKSPACE_CONFIG": workspace_config(environ)}
    workspace = blas_workspace_reserved(env)
    if given is not None:
        return ExecutorCost(given + workspace, True, "given with --context-bytes (measured "
                            "before); plus the cuBLAS(Lt) workspaces", workspace)
    try:
        done = run([sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True,
                   timeout=timeout_s, stdin=subprocess.DEVNULL)
        why = (f"exit status {done.returncode}: {(done.stderr or '').strip()[-300:]}"
               if done.returncode else "")
        context = None if why else context_bytes(done.stdout)
    except subprocess.TimeoutExpired:
        why, context = f"it took over {timeout_s:g} s", None
    if context is None:
        log.warning("could not measure a CUDA context on %s (%s): booking an estimate of %s "
                    "per executor", device.uuid, why or "NVML did not report the process",
                    format_size(GPU_CONTEXT_ESTIMATE_BYTES))
        return ExecutorCost(GPU_CONTEXT_ESTIMATE_BYTES + workspace, False, "estimate: a CUDA "
                            "context could not be measured; plus the cuBLAS(Lt) workspaces",
                            workspace)
    log.info("a CUDA context on %s costs %s (NVML's use by one process minus torch's reserved "
             "bytes), its cuBLAS(Lt) workspaces %s", device.uuid, format_size(context),
             format_size(workspace))
    return ExecutorCost(context + workspace, True, "NVML per-process used memory minus torch's "
                        "reserved bytes, measured at start; plus the cuBLAS(Lt) workspaces",
                        workspace)


def context_bytes(stdout: str) -> int | None:
    """A context's bytes from the measuring subprocess's last line ({"used", "reserved"}), or
    None where NVML did not report the process (`used` null)."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        used, reserved = report["used"], int(report["reserved"])
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return None if used is None else max(0, int(used) - reserved)
