"""What every step of the GPU kit shares: its command line, whether it runs on CUDA, a salusd
daemon as a child process, percentiles, and its one JSON object on stdout.

Each step is a script (`python bench/gpu/STEP.py [--cpu] [--small]`) that prints one JSON
object as its last stdout line; `run.py` runs them one by one, each under a time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

# `torch.cuda.is_available()` then asks NVML and leaves CUDA uninitialised in this process,
# which may host a daemon that forks executors.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = Path(__file__).resolve().parent.parent


def arguments(description: str) -> argparse.Namespace:
    """`--cpu` (CPU devices even where CUDA exists) and `--small` (the smallest sizes)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cpu", action="store_true", help="CPU devices only")
    parser.add_argument("--small", action="store_true", help="smallest sizes (CI, --cpu)")
    return parser.parse_args()


def on_cuda(cpu: bool) -> bool:
    """True when the step measures a CUDA device: not `--cpu` and torch sees one."""
    if cpu:
        return False
    import torch

    return bool(torch.cuda.is_available())


def skipped(reason: str) -> dict[str, str]:
    return {"skipped": reason}


def step_main(measure: Callable[[bool, bool], dict[str, Any]], doc: str | None) -> None:
    """A step run on its own (`python bench/gpu/STEP.py [--cpu] [--small]`): `measure(cuda,
    small)` emitted as its JSON line."""
    args = arguments((doc or "").splitlines()[0])
    emit(measure(on_cuda(args.cpu), args.small))


def emit(result: dict[str, Any]) -> None:
    """The step's result as the last line of stdout (NaN becomes null: JSON has no NaN)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    sys.stdout.flush()
    print(json.dumps(clean(result)), flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, NaN when there are fewer than 2."""
    if len(values) < 2:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


class Daemon(NamedTuple):
    address: str  # unix:///path
    socket: Path
    pid: int


@contextlib.contextmanager
def daemon(tmp: Path, *, cuda: bool, policy: str = "pack", cpu_devices: int = 1,
           cpu_memory: str = "1G", env: dict[str, str] | None = None,
           name: str = "salusd", extra: list[str] | None = None) -> Iterator[Daemon]:
    """`salusd serve` as a child process for the body: on every CUDA device (`cuda`), else on
    `cpu_devices` CPU devices of `cpu_memory` each with one thread per executor. Its output
    goes to `tmp/NAME.log`, shown if it does not start within 90 s."""
    sock, log = tmp / f"{name}.sock", tmp / f"{name}.log"
    state = tmp / f"{name}-state"
    state.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(sock),
           "--state-dir", str(state), "--policy", policy, "--log-level", "warning",
           "--http", "127.0.0.1:0"]
    if not cuda:
        cmd += ["--cpu-devices", str(cpu_devices), "--cpu-memory", cpu_memory,
                "--cpu-threads", "1"]
    elif os.environ.get("SALUS_KIT_CONTEXT_BYTES"):  # measured once by run.py
        cmd += ["--context-bytes", os.environ["SALUS_KIT_CONTEXT_BYTES"]]
    cmd += extra or []
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 90
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"salusd did not start; its log:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)
        yield Daemon(f"unix://{sock}", sock, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client(*args: str, user: str | None = None) -> subprocess.Popen[str]:
    """`python bench/gpu/clients.py ARGS...` (a job's client in its own process), with pipes:
    it prints `ready`, waits for a line on stdin, runs, prints one JSON line. `user`: run it as
    that user and its group (the kit runs as root)."""
    env = {**os.environ, "HOME": tempfile.gettempdir()} if user else None
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("clients.py")),
                             *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            user=user, group=user, extra_groups=[] if user else None, env=env,
                            cwd=tempfile.gettempdir() if user else None)


def wait_ready(proc: subprocess.Popen[str]) -> None:
    """Block until a client said `ready` (RuntimeError when it died first)."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"a client failed to start (exit {proc.poll()}, said {line!r})")


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def stop(proc: subprocess.Popen[str]) -> None:
    """Tell a client started to run until stopped (`train ... 0`) to stop."""
    go(proc)


def next_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The next JSON line of a client that goes on running (`serve-train`)."""
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith("{"):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
    raise RuntimeError(f"a client ended without its result (exit {proc.wait()})")


def end(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """End a `serve-train` client (an empty line), killing it if it does not go."""
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def result_of(proc: subprocess.Popen[str], timeout_s: float = 300.0) -> dict[str, Any]:
    """The client's JSON line, once it has ended."""
    out, _ = proc.communicate(timeout=timeout_s)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a client failed (exit {proc.returncode}): {out[-2000:]}")
    parsed: dict[str, Any] = json.loads(lines[-1])
    return parsed
