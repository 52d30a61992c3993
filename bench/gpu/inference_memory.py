"""16 inference models through one salusd against 16 separate processes: device memory by NVML
per process on CUDA, PSS on the CPU (anchor: Salus, 42x fewer GPUs for inference).

bench/packing.py's inference case (its `infer-mlp` model, about 17 MiB of parameters, and its
process-tree PSS reading). On CUDA, `nvmlDeviceGetComputeRunningProcesses` gives each process's
device memory (bytes, its CUDA context included): summed over the daemon's process tree while
the N jobs are open, and over N processes that each hold one model on cuda:0. The daemon's
inference jobs of one owner share a lane and its executor (`--isolation lane`, the default), so
its side should hold one CUDA context against N. Where NVML lists no pids (a container's pid
namespace), the ratio is of NVML's device-wide used memory growth instead (`device_measure`
says which). PSS (host memory) is reported on both backends.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import kit

from salus.demo.jobs import Launched
from salus.demo.scripts import group_memory, tree


def device_bytes(pids: set[int]) -> tuple[int, list[int]]:
    """(sum, per-process list) of NVML's used device memory of `pids` on every GPU, bytes."""
    import pynvml

    pynvml.nvmlInit()
    try:
        used = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    used.append(int(proc.usedGpuMemory))
    finally:
        pynvml.nvmlShutdown()
    return sum(used), sorted(used, reverse=True)


def _direct_cuda(models: int) -> tuple[int, list[int], int, int]:
    """N processes holding one model each on cuda:0: (device bytes by NVML per process, per
    process, PSS, NVML's device-wide used bytes while they hold them)."""
    procs = [kit.client("hold-infer") for _ in range(models)]
    try:
        for p in procs:
            kit.wait_ready(p)
        for p in procs:
            kit.go(p)
        pids = set()
        for p in procs:
            assert p.stdout is not None
            pids.add(int(json.loads(p.stdout.readline())["pid"]))
        total, each = device_bytes(pids)
        pss = group_memory(sorted(pids))[0]
        used = device_used()
    finally:
        for p in procs:
            kit.go(p)
            p.wait(timeout=60)
    return total, each, pss, used


def device_used() -> int:
    """NVML's used memory of GPU 0 (bytes): every process's, the driver's reserve included."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    models = 4 if small else 16
    out: dict[str, Any] = {"models": models, "anchor": "Salus: 42x fewer GPUs for inference "
                                                      "(7x over MPS)"}
    before = device_used() if cuda else 0
    with (tempfile.TemporaryDirectory(prefix="salusd-kit-mem-") as tmp,
          kit.daemon(Path(tmp), cuda=cuda, cpu_memory="2G") as d,
          Launched(["infer-mlp"] * models, d.address, hold=True)):
        processes = tree(d.pid)
        out["daemon_processes"] = len(processes)
        out["daemon_pss_bytes"] = group_memory(processes)[0]
        if cuda:
            out["daemon_device_bytes"], out["daemon_device_bytes_by_process"] = device_bytes(
                set(processes))
            # Where NVML cannot see the executors' pids (a container's pid namespace), the
            # device-wide use before and with the jobs open is the fallback.
            out["nvml_lists_executor_pids"] = bool(out["daemon_device_bytes_by_process"])
            out["device_used_before_bytes"] = before
            out["device_used_with_jobs_bytes"] = device_used()
    if cuda:
        before_direct = device_used()
        total, each, pss, used = _direct_cuda(models)
        out["processes_device_bytes"], out["processes_device_bytes_by_process"] = total, each
        out["processes_pss_bytes"] = pss
        out["device_used_before_processes_bytes"] = before_direct
        out["device_used_with_processes_bytes"] = used
        if out["nvml_lists_executor_pids"] and each:
            out["device_measure"] = "NVML per-process used memory"
            out["processes_over_daemon_device"] = total / max(1, out["daemon_device_bytes"])
        else:  # NVML lists no pids here: the device-wide growth of each group
            out["device_measure"] = "NVML device-wide used memory, with minus before"
            daemon_grew = out["device_used_with_jobs_bytes"] - before
            out["processes_over_daemon_device"] = ((used - before_direct) / daemon_grew
                                                   if daemon_grew > 0 else None)
    else:
        with Launched(["infer-mlp"] * models, "direct", hold=True) as group:
            out["processes_pss_bytes"] = group_memory([r["pid"] for r in group.results])[0]
        out["processes_over_daemon_device"] = kit.skipped("CPU run: no device memory; PSS only")
    out["processes_over_daemon_pss"] = out["processes_pss_bytes"] / out["daemon_pss_bytes"]
    return out


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
