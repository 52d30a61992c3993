"""Caps and faults: a job whose call allocates past its lane, and a fatal fault in one executor
(an illegal memory access on CUDA; a segfault on both backends), each beside a job that keeps
training; on CUDA with and without NVIDIA MPS where `nvidia-cuda-mps-control` exists.

Each case: job A trains without pause in its own client process; job B (this process) makes
one small call (its lane) and, 1 s later, the bad call; A's calls in the 1.5 s before it and
after it are counted from A's call end times (the machine's monotonic clock).
`a_kept_training` is true when A completed calls after B's call returned and saw no error.
The MPS case runs `salusd serve --mps` (a control daemon per GPU, its executors MPS clients;
a fatal fault is then expected to reach every client on that GPU).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jobfns
import kit
import models

import salus.adapters.torch as salus
from salus.daemon.cli.control import Control

AFTER_S = 1.5  # how long A trains on after B's bad call returned


def _beside(address: str, cuda: bool, bad: Callable[[Any], Any]) -> dict[str, Any]:
    """Job A trains while job B calls `bad(remote)` once; what each saw."""
    width = 1024 if cuda else 64
    trainer = kit.client("train", address, "a", "0", str(width), str(width))  # until stopped
    kit.wait_ready(trainer)
    kit.go(trainer)
    model = models.mlp(width)
    out: dict[str, Any] = {}
    with salus.connect(name="b", iterations=10, address=address) as job:
        remote = job.attach(model=model)
        remote.function(jobfns.infer)(models.batch(width, 32)[0])  # B's lane: a small call
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            out["b_result"] = repr(bad(remote))[:300]
            out["b_failed"] = False
        except Exception as exc:  # noqa: BLE001 - the failure is the figure
            out["b_error"] = f"{type(exc).__name__}: {exc}"[:600]
            out["b_failed"] = True
        t1 = time.monotonic()
        try:
            out["b_state_after"] = job.info().get("state")
        except Exception as exc:  # noqa: BLE001 - the job may be gone with its executor
            out["b_state_after"] = f"unreadable: {type(exc).__name__}"
    time.sleep(AFTER_S)  # A trains on after B's fault, however long the fault took
    kit.stop(trainer)
    a = kit.result_of(trainer)
    after = sum(t > t1 for t in a["ends"])
    out.update({
        "b_call_s": t1 - t0,
        "a_calls_1_5s_before": sum(t0 - 1.5 <= t < t0 for t in a["ends"]),
        "a_calls_after": after,
        "a_error": a["error"],
        "a_kept_training": after > 0 and a["error"] is None and a["losses_finite"],
    })
    return out


def _over_lane(nbytes: int) -> Callable[[Any], Any]:
    return lambda remote: remote.function(jobfns.allocate)(nbytes)


def _fault_cases(tmp: Path, cuda: bool, env: dict[str, str] | None,
                 name: str, extra: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with kit.daemon(tmp, cuda=cuda, cpu_memory="512M", env=env, name=name,
                    extra=extra) as d:
        with Control(d.address) as ctl:
            out["gpu_sharing"] = [dev.get("sharing") for dev in ctl.status()["devices"]]
        over = 4 * 2**30 if cuda else 2**30
        cases: dict[str, Callable[[Any], Any]] = {
            f"over_lane_{over >> 20}MiB": _over_lane(over),
            "segfault": lambda remote: remote.function(jobfns.segfault)(),
        }
        if cuda:
            cases["illegal_memory_access"] = lambda r: r.function(jobfns.illegal_access)()
        for case, bad in cases.items():
            try:
                out[case] = _beside(d.address, cuda, bad)
            except Exception as exc:  # noqa: BLE001 - one case's failure is its figure
                out[case] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if not cuda:
        out["illegal_memory_access"] = kit.skipped("needs CUDA")
    return out


def _with_mps(tmp: Path) -> dict[str, Any]:
    """The same cases under `salusd serve --mps` (one MPS control daemon per GPU, its
    executors MPS clients), with what status said of the GPU's sharing."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        return kit.skipped("nvidia-cuda-mps-control is not on PATH")
    out = _fault_cases(tmp, True, None, "salusd-mps", ["--mps"])
    logs = sorted((tmp / "salusd-mps-state" / "mps").glob("*/log/server.log"))
    out["mps_server_log_tail"] = logs[0].read_text()[-1500:] if logs else None
    return out


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    del small  # every case is already short
    with tempfile.TemporaryDirectory(prefix="salusd-kit-faults-") as tmp:
        out: dict[str, Any] = {"without_mps": _fault_cases(Path(tmp), cuda, None, "salusd")}
        try:
            out["with_mps"] = _with_mps(Path(tmp)) if cuda else kit.skipped("needs CUDA")
        except Exception as exc:  # noqa: BLE001 - keep the figures without MPS
            out["with_mps"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
