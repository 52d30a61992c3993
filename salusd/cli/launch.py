"""Start `salusd serve` as a child process and wait until it listens (demo and benchmarks)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from salus.scheduler.policies import DEFAULT_POLICY


class DaemonProcess(NamedTuple):
    address: str  # unix:///path
    pid: int


@contextlib.contextmanager
def running_daemon(
    socket: Path,
    *,
    state_dir: Path,
    policy: str = DEFAULT_POLICY,
    cpu_devices: int = 1,
    cpu_memory: str = "2G",
    cpu_threads: int | None = None,
    log_file: Path | None = None,
    log_level: str = "warning",
    timeout_s: float = 60.0,
    http: str = "127.0.0.1:0",
    extra_args: Sequence[str] = (),
) -> Iterator[DaemonProcess]:
    """Run a CPU daemon on `socket` for the body; yields its address and pid. Its output goes
    to `log_file` (shown if it fails to start) or nowhere; it is terminated afterwards.
    `extra_args` are more `salusd serve` options."""
    cmd = [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(socket),
           "--state-dir", str(state_dir), "--cpu-devices", str(cpu_devices),
           "--cpu-memory", cpu_memory, "--policy", policy, "--log-level", log_level,
           "--http", http]
    if cpu_threads is not None:
        cmd += ["--cpu-threads", str(cpu_threads)]
    cmd += list(extra_args)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log_file, "wb")) if log_file else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = log_file.read_text() if log_file else "(not kept)"
                raise RuntimeError(f"salusd did not start; its log:\n{log}")
            time.sleep(0.05)
        yield DaemonProcess(f"unix://{socket}", proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
