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
re-allocation of the whole working set; salusd keeps the cache when the lane fits. Beside it,
`large.emptying_cache`: the same two jobs whose every call ends with `torch.cuda.empty_cache()`
(`jobfns.train_emptying`), so that each call allocates its working set again; the ratio of the
median calls is what emptying the cache at each switch would cost (1 on the CPU, which has no
cache). Each trainer reports its executor's `torch.cuda.memory_stats()` after its last call.

`two_owners`: one lane shared by two owners: job A's client runs as root, job B's as a
throw-away user (made with `useradd` and removed after; skipped when the kit is not root), so
each job runs in an executor of its own owner's uid and every switch crosses processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kit

sys.path.insert(0, str(kit.BENCH))
import switch as base  # noqa: E402 - bench/switch.py's event reading

from salus.daemon.cli.control import Control  # noqa: E402
from salus.daemon.daemon import Daemon, DaemonConfig  # noqa: E402
from salus.daemon.devices.discovery import cpu_devices, cuda_devices  # noqa: E402


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


def _daemon(tmp: str, cuda: bool, group: str | None = None
            ) -> tuple[Daemon, threading.Thread, str]:
    devices = cuda_devices()[:1] if cuda else cpu_devices(1, 2 * 2**30)
    given = os.environ.get("SALUS_KIT_CONTEXT_BYTES")
    config = DaemonConfig(str(Path(tmp) / "s.sock"), devices, "fair", group=group,
                          context_bytes=int(given) if cuda and given else None)
    daemon = Daemon(config)
    daemon.engine.events.recent = deque(maxlen=10**6)  # every call of the run, not 10k
    daemon.start()
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    return daemon, loop, f"unix://{config.socket_path}"


def _clients(address: str, users: tuple[str | None, ...]) -> list[Any]:
    """`serve-train` clients (torch imported once for every case), one per user (None: this
    process's), ready."""
    procs = [kit.client("serve-train", address, user=u) for u in users]
    for p in procs:
        kit.wait_ready(p)
    return procs


def _trainers(clients: list[Any], names: tuple[str, ...], seconds: float, width: int,
              rows: int, fn: str = "train") -> list[Any]:
    """Jobs `names` that train with `jobfns.<fn>` without pause for `seconds`, one in each of
    `clients`, started together once all are admitted; their results come with
    `kit.next_result`."""
    for p, name in zip(clients, names, strict=True):
        assert p.stdin is not None
        p.stdin.write(f"{name} {seconds} {width} {rows} {fn}\n")
        p.stdin.flush()
    for p in clients:
        kit.wait_ready(p)
    for p in clients:
        kit.go(p)
    return clients


def _call_ms(daemon: Daemon, names: set[str]) -> list[float]:
    """Each call's duration, `ended - began` as the executors stamped it, of the jobs `names`
    (milliseconds)."""
    ids = {e.job_id for e in list(daemon.engine.events.recent)
           if e.kind == "open" and e.detail.get("name") in names}
    return [(e.detail["ended"] - e.detail["began"]) * 1e3 for e in list(daemon.engine.events.recent)
            if e.job_id in ids and e.kind == "end" and e.detail.get("began")]


def _pair(daemon: Daemon, clients: list[Any], names: tuple[str, str], width: int, rows: int,
          seconds: float, fn: str) -> dict[str, Any]:
    """Two jobs training with `jobfns.<fn>` in one lane for `seconds`: their warm switches,
    calls, and the first trainer's executor's memory stats."""
    procs = _trainers(clients, names, seconds, width, rows, fn)
    results = [kit.next_result(p) for p in procs]
    warm, same = base._gaps(daemon, set(names))
    calls = _call_ms(daemon, set(names))
    return {"warm_switches": len(warm),
            "warm_switch_p50_ms": statistics.median(warm) * 1e3 if warm else None,
            "warm_switch_p99_ms": kit.percentile(warm, 99) * 1e3,
            "same_job_gap_p50_ms": statistics.median(same) * 1e3 if same else None,
            "call_ms_median": statistics.median(calls) if calls else None,
            "client_errors": [r["error"] for r in results if r["error"]],
            "executor_memory_stats": results[0].get("memory_stats")}


def _large(daemon: Daemon, clients: list[Any], cuda: bool, small: bool) -> dict[str, Any]:
    """Warm switches between two jobs with GB-scale working sets (on the CPU, tens of MiB),
    keeping the allocator's cache, and again emptying it at the end of every call."""
    width, rows = (12288, 2048) if cuda else ((512, 256) if small else (2048, 512))
    warm_s = 1.5 if small else 4.0
    kept = _pair(daemon, clients, ("la", "lb"), width, rows, warm_s, "train")
    emptying = _pair(daemon, clients, ("ea", "eb"), width, rows, warm_s, "train_emptying")
    emptying.pop("executor_memory_stats")
    kept_ms, emptying_ms = kept["call_ms_median"], emptying["call_ms_median"]
    emptying["emptying_over_kept_call"] = (emptying_ms / kept_ms if kept_ms and emptying_ms
                                           else None)
    return {"width": width, "parameter_bytes_per_job": 3 * width * width * 4, **kept,
            "emptying_cache": emptying}


@contextlib.contextmanager
def throwaway_user() -> Iterator[tuple[str | None, str]]:
    """(name, "") of a system user with a group of its own name, no home and no login shell
    that can run this Python, removed after; (None, why) where there cannot be one."""
    if os.geteuid() != 0:
        yield None, "not root: the kit makes a throw-away user with useradd as root"
        return
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        yield None, "useradd or userdel is not on PATH"
        return
    name = f"salusdkit{os.getpid()}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                    "/usr/sbin/nologin", name], check=True, capture_output=True, timeout=30)
    try:
        with tempfile.TemporaryDirectory(prefix="salusd-kit-user-") as cwd:
            os.chmod(cwd, 0o755)
            cannot = _cannot_run(name, cwd)
        yield (None, f"the throw-away user cannot run the kit's Python {sys.executable}: "
               f"{cannot}") if cannot else (name, "")
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)
        subprocess.run(["groupdel", name], capture_output=True, timeout=30)  # if left


def _uids(pids: list[int]) -> dict[int, int]:
    """pid -> real uid of each process still alive."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            out[pid] = int(next(line.split()[1] for line in status.splitlines()
                                if line.startswith("Uid:")))
    return out


def _cannot_run(user: str, cwd: str) -> str:
    """Why `user` cannot import salus.adapters.torch with this Python, or ""."""
    try:
        probe = subprocess.run([sys.executable, "-c", "import salus.adapters.torch"], user=user,
                               group=user, extra_groups=[], cwd=cwd, capture_output=True,
                               text=True, timeout=120, env={**os.environ, "HOME": cwd})
    except OSError as exc:  # e.g. the interpreter lies under a folder only root may enter
        return f"{type(exc).__name__}: {exc}"
    return probe.stderr.strip()[-300:] if probe.returncode else ""


def _two_owners(daemon: Daemon, address: str, clients: list[Any], cuda: bool, small: bool,
                user: str) -> dict[str, Any]:
    """Two owners' jobs in one lane: A's client as this process's user (root), B's as the
    throw-away `user`."""
    width, rows = (1024, 256) if cuda else (64, 32)
    warm_s = 1.5 if small else 4.0
    other = _clients(address, (user,))
    try:
        procs = _trainers([clients[0], *other], ("oa", "ob"), warm_s + 1.0, width, rows)
        time.sleep(warm_s)
        with Control(address) as ctl:
            jobs = [j for j in ctl.status().get("jobs", []) if j.get("name") in ("oa", "ob")]
        uids = _uids([j["executor_pid"] for j in jobs if j.get("executor_pid")])
        results = [kit.next_result(p) for p in procs]
    finally:
        kit.end(other[0])
    warm, same = base._gaps(daemon, {"oa", "ob"})
    user_uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True,
                                  timeout=10).stdout or -1)
    lanes = {j.get("lane") for j in jobs}
    return {
        "user": user,
        "owners": sorted(str(j.get("owner")) for j in jobs),
        "lanes": sorted(str(lane) for lane in lanes),
        "same_lane": len(jobs) == 2 and len(lanes) == 1,
        "executor_uids": sorted(uids.values()),
        "executor_uids_differ": sorted(uids.values()) == sorted({0, user_uid}),
        "client_uids": sorted(r["uid"] for r in results),
        "warm_switches": len(warm),
        "warm_switch_p50_ms": statistics.median(warm) * 1e3 if warm else None,
        "warm_switch_p99_ms": kit.percentile(warm, 99) * 1e3,
        "same_job_gap_p50_ms": statistics.median(same) * 1e3 if same else None,
        "calls": [r["calls"] for r in results],
        "both_trained": all(r["calls"] > 0 and r["error"] is None for r in results),
        "client_errors": [r["error"] for r in results if r["error"]],
    }


def _warm(daemon: Daemon, address: str, clients: list[Any], cuda: bool,
          small: bool) -> dict[str, Any]:
    """Warm switches between two small training jobs, then B suspended and resumed."""
    width, rows = (1024, 256) if cuda else (64, 32)
    rounds = 2 if small else 5
    warm_s = 2.0 if small else 6.0
    total = warm_s + rounds * 2 * 0.6 + 3.0
    procs = _trainers(clients, ("a", "b"), total, width, rows)
    time.sleep(warm_s)
    warm, same = base._gaps(daemon, {"a", "b"})
    ids = {e.detail.get("name"): e.job_id for e in list(daemon.engine.events.recent)
           if e.kind == "open"}
    swapped = _resumes(daemon, address, ids["b"], rounds, swap=True)
    resumed = _resumes(daemon, address, ids["b"], rounds, swap=False)
    results = [kit.next_result(p) for p in procs]
    return {
        "device": daemon.config.devices[0].name,
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
    }


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    """Every case on one daemon (its socket's group the throw-away user's, where there is
    one), one case after another, each with jobs of its own names."""
    with (throwaway_user() as (user, why),
          tempfile.TemporaryDirectory(prefix="salusd-kit-switch-") as tmp):
        os.chmod(tmp, 0o755)  # the other owner reaches the socket (0660, its group) through it
        daemon, loop, address = _daemon(tmp, cuda, group=user)
        clients = _clients(address, (None, None))
        try:
            out = _warm(daemon, address, clients, cuda, small)
            out["large"] = _guarded(lambda: _large(daemon, clients, cuda, small))
            out["two_owners"] = (
                _guarded(lambda: _two_owners(daemon, address, clients, cuda, small, user))
                if user else kit.skipped(why))
        finally:
            for client in clients:
                kit.end(client)
            daemon.request_stop()
            loop.join(timeout=60)
    return out


def _guarded(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A case's figures, or its error (the step's other figures stay)."""
    try:
        result = case()
    except Exception as exc:  # noqa: BLE001 - one case's failure is its figure
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return result


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
