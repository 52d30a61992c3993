"""Switch latency A->B between two training jobs sharing one device's lane under `fair`, warm
and after `suspend --swap` / resume (anchor: PipeSwitch's 3.6-6.6 ms start-up).

bench/switch.py's method: an in-process daemon (the real engine, zygote and executors) on one
device; two clients always have their next call queued, so every boundary is a switch, and
the executors stamp each call's start and end on the machine's monotonic clock: a warm switch
is `began(B) - ended(A)`. salusd synchronises the job's device at the end of every call before
it stamps `ended` (`salusd/executor/cuda_call.py`; the jobs' functions end with
`torch.cuda.synchronize()` too, which then costs nothing), so on CUDA `ended` is when the GPU
finished, not when the kernels were queued. After swap: job B is suspended with its state
moved to host memory, then resumed; the figure is `began(B's first call) - t(resume)`, which
holds the swap-in and the wait for A's running call; the same without `--swap` is measured
beside it.

`large`: the same warm switches between two jobs whose working sets are GB-scale on a GPU (an
MLP of width 12288: about 1.8 GB of parameters and as much gradient each), the case where
emptying the allocator's cache at every switch would cost a device-wide synchronisation and a
re-allocation of the whole working set; salusd keeps the cache when the lane fits.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import kit

sys.path.insert(0, str(kit.BENCH))
import switch as base  # noqa: E402 - bench/switch.py's event reading

from salus.daemon.control import Control  # noqa: E402
from salus.daemon.daemon import Daemon, DaemonConfig  # noqa: E402
from salus.daemon.devices import cpu_devices, cuda_devices  # noqa: E402


def _first_call_after(daemon: Daemon, job_id: int, t: float) -> float | None:
    for e in list(daemon.engine.events.recent):
        if e.job_id == job_id and e.kind == "end" and (e.detail.get("began") or 0) > t:
            return float(e.detail["began"])
    return None


def _resumes(daemon: Daemon, address: str, job_id: int, rounds: int, swap: bool) -> list[float]:
    """Seconds from each resume to the job's first call after it."""
    out = []
    with Control(address) as ctl:
        for _ in range(rounds):
            ctl.suspend(str(job_id), swap=swap)
            time.sleep(0.3)  # the suspension (and swap-out) takes effect at B's next boundary
            t = time.monotonic()
            ctl.resume(str(job_id))
            began = None
            while began is None and time.monotonic() - t < 5.0:
                time.sleep(0.05)
                began = _first_call_after(daemon, job_id, t)
            if began is not None:
                out.append(began - t)
    return out


def _daemon(tmp: str, cuda: bool) -> tuple[Daemon, threading.Thread, str]:
    devices = cuda_devices()[:1] if cuda else cpu_devices(1, 2 * 2**30)
    given = kit.os.environ.get("SALUS_KIT_CONTEXT_BYTES")
    config = DaemonConfig(str(Path(tmp) / "s.sock"), devices, "fair",
                          context_bytes=int(given) if cuda and given else None)
    daemon = Daemon(config)
    daemon.engine.events.recent = deque(maxlen=10**6)  # every call of the run, not 10k
    daemon.start()
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    return daemon, loop, f"unix://{config.socket_path}"


def _trainers(address: str, names: tuple[str, ...], seconds: float, width: int,
              rows: int) -> list[Any]:
    """Clients that train without pause for `seconds`, started together."""
    procs = [kit.client("train", address, n, str(seconds), str(width), str(rows))
             for n in names]
    for p in procs:
        kit.wait_ready(p)
    for p in procs:
        kit.go(p)
    return procs


def _large(cuda: bool, small: bool) -> dict[str, Any]:
    """Warm switches between two jobs with GB-scale working sets (on the CPU, tens of MiB)."""
    width, rows = (12288, 2048) if cuda else ((512, 256) if small else (2048, 512))
    warm_s = 2.0 if small else 4.0
    with tempfile.TemporaryDirectory(prefix="salusd-kit-switch-large-") as tmp:
        daemon, loop, address = _daemon(tmp, cuda)
        procs = _trainers(address, ("la", "lb"), warm_s + 2.0, width, rows)
        time.sleep(warm_s)
        warm, same = base._gaps(daemon, {"la", "lb"})
        results = [kit.result_of(p) for p in procs]
        daemon.request_stop()
        loop.join(timeout=60)
    return {"width": width, "parameter_bytes_per_job": 3 * width * width * 4,
            "warm_switches": len(warm),
            "warm_switch_p50_ms": statistics.median(warm) * 1e3 if warm else None,
            "warm_switch_p99_ms": kit.percentile(warm, 99) * 1e3,
            "same_job_gap_p50_ms": statistics.median(same) * 1e3 if same else None,
            "client_errors": [r["error"] for r in results if r["error"]]}


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    width, rows = (1024, 256) if cuda else (64, 32)
    rounds = 2 if small else 5
    warm_s = 2.0 if small else 6.0
    total = warm_s + rounds * 2 * 0.6 + 3.0
    with tempfile.TemporaryDirectory(prefix="salusd-kit-switch-") as tmp:
        daemon, loop, address = _daemon(tmp, cuda)
        device = daemon.config.devices[0].name
        procs = _trainers(address, ("a", "b"), total, width, rows)
        time.sleep(warm_s)
        warm, same = base._gaps(daemon, {"a", "b"})
        ids = {e.detail.get("name"): e.job_id for e in list(daemon.engine.events.recent)
               if e.kind == "open"}
        swapped = _resumes(daemon, address, ids["b"], rounds, swap=True)
        resumed = _resumes(daemon, address, ids["b"], rounds, swap=False)
        results = [kit.result_of(p) for p in procs]
        daemon.request_stop()
        loop.join(timeout=60)
    return {
        "device": device,
        "unit": "milliseconds",
        "synchronised": "salusd synchronises the device at the end of every call" if cuda
                        else "CPU: synchronous",
        "warm_switches": len(warm),
        "warm_switch_p50_ms": statistics.median(warm) * 1e3 if warm else None,
        "warm_switch_p99_ms": kit.percentile(warm, 99) * 1e3,
        "same_job_gap_p50_ms": statistics.median(same) * 1e3 if same else None,
        "after_swap_resume_to_call_ms": [v * 1e3 for v in swapped],
        "after_resume_no_swap_to_call_ms": [v * 1e3 for v in resumed],
        "swap_over_no_swap": (statistics.median(swapped) / statistics.median(resumed)
                              if swapped and resumed else None),
        "client_errors": [r["error"] for r in results if r["error"]],
        "anchor": "PipeSwitch start-up 3.6-6.6 ms (total switch 5.4-34.6 ms), V100/T4",
        "large": _large(cuda, small),
    }


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
