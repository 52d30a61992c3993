"""The one way tests start the real `salusd serve` process, and the one way they wait for
something it does.

Every test that needs a daemon process goes through `salusd()` (directly, or through a module's
fixture built on it), so a change to how the daemon starts or says it is up is made here once.
Tests wait on something they can observe with `wait_until()`, never by sleeping a guessed time.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

START_TIMEOUT_S = 120.0  # torch's import alone takes ~10 s on a loaded two-core machine


def wait_until(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Call `check()` every `every_s` seconds until it returns something truthy, and return
    that; fail with `what` (a phrase naming the awaited condition) and the last value seen if
    `timeout_s` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} "
                                 f"(last seen: {value!r})")
        time.sleep(every_s)


@dataclass
class RunningDaemon:
    """A `salusd serve` process a test started: its process, its socket's address
    (`unix://...`), its state dir and the file its log (stderr) goes to.

    It unpacks as `(proc, address)`, so `with salusd(tmp) as (proc, address):` reads as the
    many tests written that way do."""

    proc: subprocess.Popen[str]
    address: str
    state_dir: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> Path:
        return Path(self.address.removeprefix("unix://"))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def __iter__(self) -> Iterator[object]:
        return iter((self.proc, self.address))


@contextlib.contextmanager
def salusd(tmp: Path, *args: str, devices: int = 2, memory: str = "512M", gpus: bool = False,
           env: dict[str, str] | None = None) -> Iterator[RunningDaemon]:
    """A running daemon on `tmp/salusd.sock` with `devices` CPU devices of `memory` each
    (`gpus`: the machine's GPUs instead), its state in `tmp/state` and its log in
    `tmp/salusd.log`; `args` go to `salusd serve` as they are (no REST API unless they name
    `--http`). `env` replaces the environment it gets (this one, with `OMP_NUM_THREADS=1`).
    It is up once its socket exists and it printed where it listens; it is killed afterwards
    if still alive."""
    sock = tmp / "salusd.sock"
    state = tmp / "state"
    log_path = tmp / "salusd.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(sock),
         "--state-dir", str(state),
         *(() if gpus else ("--cpu-devices", str(devices), "--cpu-memory", memory)),
         "--cpu-threads", "1", *(() if "--http" in args else ("--http", "none")),
         *args],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        _await_listening(proc, sock, log_path)
        yield RunningDaemon(proc, f"unix://{sock}", state, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _await_listening(proc: subprocess.Popen[str], sock: Path, log_path: Path) -> None:
    """Return once `proc` printed that it listens on `sock` (after its socket exists and its
    signal handlers are in place: a SIGTERM from then on stops it cleanly); fail with its log if
    it exits first or takes more than START_TIMEOUT_S seconds. Reads the pipe's descriptor
    directly so that a wait can time out."""
    assert proc.stdout is not None
    fd, said = proc.stdout.fileno(), b""
    deadline = time.monotonic() + START_TIMEOUT_S
    while b"\n" not in said.partition(b"salusd listening on")[2]:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            why = (f"exited with status {proc.wait(timeout=30)}" if ready else
                   f"did not say it listens within {START_TIMEOUT_S} s")
            raise AssertionError(f"salusd {why}; its log:\n"
                                 + log_path.read_text(errors="replace"))
        said += chunk
    assert f"listening on unix://{sock}\n".encode() in said and sock.exists(), said


def rss(pid: int) -> int:
    """Resident set size of process `pid`, in bytes (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


JOBS = Path(__file__).parent / "jobs"


def job_root(tmp: Path, *names: str) -> Path:
    """`tmp/job-root` (made readable to every job owner) holding the job files `names` from
    tests/jobs, for a daemon's `--job-root`."""
    root = tmp / "job-root"
    root.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(JOBS / name, root / name)
    os.chmod(root, 0o755)
    return root
