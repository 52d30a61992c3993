"""NVIDIA MPS: one control daemon per GPU, so that the lanes' executor processes on a GPU run
their kernels concurrently instead of time-sliced.

Without MPS, kernels of different processes on one GPU never run at once: the GPU switches
between their contexts, so parallel lanes gain nothing on it and the scheduler's lanes are
time-shared at iteration boundaries. With MPS, every executor is an MPS client of its GPU's
server and their kernels share the GPU's SMs.

Each GPU gets its own control daemon (`nvidia-cuda-mps-control -d`) with its own pipe and log
directories under the daemon's state directory and `CUDA_VISIBLE_DEVICES` set to that GPU's
UUID, so one GPU's server faults or restarts alone. An executor becomes a client of its GPU's
server when it is placed there, before CUDA starts in it (`Place.mps`), with
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` set to its process's cap plus its CUDA context (`Place`'s
`mps_limit_bytes`; the cap covers the jobs placed in it) and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
to its job's share (`thread_percentage`): no client can take memory the ledger gave to
something else on the GPU.

A salusd that was killed leaves its control daemons running: each one's pid is recorded beside
its pipe directory (`control.pid`), and the next start stops every control daemon it finds
under its root, or under the temporary root of a salusd that is gone (`salusd-<pid>`), by
`quit` on its pipe, else by its recorded pid.

The trade-offs (docs/runtime.md): a fatal fault in one client (an illegal memory access) brings
down the GPU's MPS server and with it every client on that GPU, where without MPS it costs
only its own process; and a control daemon serves one user's clients at a time (legacy MPS
starts a server per uid and makes a client of another uid wait until the running server's
clients are gone), so admission places one owner's jobs at a time on an MPS GPU
(`salus.scheduler.mps`) and MPS pays only on a GPU whose jobs are one owner's. salusd therefore
starts MPS only when asked (`salusd serve --mps`), never by default, even as root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from salus.daemon.devices.discovery import DeviceSpec

log = logging.getLogger("salusd.mps")

CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 30.0
QUIT_WAIT_S = 10.0  # how long a stale control daemon has to end after `quit` before SIGKILL
PID_FILE = "control.pid"  # beside a GPU's pipe and log directories: its control daemon's pid
_TEMP_ROOT = re.compile(r"salusd-(\d+)")  # the root of a salusd without a state directory

Run = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class MpsGpu:
    """One GPU's control daemon: its UUID and its pipe and log directories."""

    uuid: str
    pipe: Path
    logs: Path

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The environment the control daemon (and `quit`) runs with."""
        return {**base, "CUDA_VISIBLE_DEVICES": self.uuid,
                "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
                "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}


def client_environment(pipe: str, limit_bytes: int,
                       threads: int | None = None) -> dict[str, str]:
    """What an executor sets before CUDA starts in it to be a client of the server behind
    `pipe`, held to `limit_bytes` of device memory (its one visible GPU is device 0; rounded
    up to MiB) and, with `threads`, to that percentage of the GPU's threads."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe,
           "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={max(1, -(-limit_bytes >> 20))}M"}
    if threads is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(threads)
    return env


def thread_percentage(priority: float) -> int:
    """A job's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` from its priority (the fair policy's weight,
    default 1): weight 1 or more gets every thread; a lower weight that share, at least 10 %
    (a client with too few threads starves its own kernels)."""
    return 100 if priority >= 1.0 else max(10, min(100, round(100 * priority)))


class Mps:
    """The MPS control daemons of the daemon's GPUs (`root`: where their directories go)."""

    def __init__(self, root: Path, devices: Sequence[DeviceSpec], *,
                 run: Run = subprocess.run,
                 which: Callable[[str], str | None] = shutil.which) -> None:
        self.root = root
        self.control = which(CONTROL)
        self.gpus = {d.uuid: MpsGpu(d.uuid, root / "mps" / d.uuid / "pipe",
                                    root / "mps" / d.uuid / "log")
                     for d in devices if d.kind == "cuda" and d.uuid}
        self.running: dict[str, MpsGpu] = {}
        self.problem: str | None = None
        self._run = run

    def start(self) -> None:
        """Start one control daemon per GPU; where that cannot be done, `problem` says why and
        the GPUs are time-shared (the daemon goes on without MPS)."""
        if self.control is None:
            self.problem = f"{CONTROL} is not installed"
            return
        for home in stale_homes(self.root):
            self._stop_stale(home)
        for uuid, gpu in self.gpus.items():
            for directory in (gpu.pipe, gpu.logs):
                directory.mkdir(parents=True, exist_ok=True)
                os.chmod(directory, 0o755)  # the owners' executors reach the pipe
            try:
                done = self._run([self.control, "-d"], env=gpu.environment(dict(os.environ)),
                                 capture_output=True, text=True, timeout=START_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.problem = f"{CONTROL} -d failed on {uuid}: {exc}"
                break
            if done.returncode:
                self.problem = (f"{CONTROL} -d exited {done.returncode} on {uuid}: "
                                f"{(done.stderr or '').strip()[-300:]}")
                break
            self.running[uuid] = gpu
            pid = control_pid(gpu.pipe)
            if pid is not None:
                (gpu.pipe.parent / PID_FILE).write_text(f"{pid}\n")
            log.info("MPS control daemon %s started for %s (pipes in %s)", pid, uuid, gpu.pipe)
        if self.problem is not None:
            log.error("MPS not used: %s", self.problem)
            self.stop()

    def _stop_stale(self, home: Path) -> None:
        """Stop the control daemon a salusd that was killed left in `home` (a GPU's directory):
        `quit` on its pipe (its servers end with it), then its recorded pid if it is still
        there; a dead salusd's temporary root goes too."""
        gpu = MpsGpu(home.name, home / "pipe", home / "log")
        pid = _recorded_pid(home)
        if (gpu.pipe / "control").exists():
            log.warning("stopping the MPS control daemon a previous salusd left in %s", home)
            try:
                self._run([self.control or CONTROL], input="quit\n",
                          env=gpu.environment(dict(os.environ)), capture_output=True,
                          text=True, timeout=START_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("could not ask it to quit: %s", exc)
        if pid is not None and not _ended(pid, QUIT_WAIT_S if gpu.pipe.exists() else 0.0):
            log.warning("killing the MPS control daemon pid %d a previous salusd left", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _ended(pid, QUIT_WAIT_S)
        (home / PID_FILE).unlink(missing_ok=True)
        if home.parent.parent != self.root:  # under a dead salusd's temporary root
            shutil.rmtree(home, ignore_errors=True)
            with contextlib.suppress(OSError):
                home.parent.rmdir()
                home.parent.parent.rmdir()

    def pipe_for(self, uuid: str | None) -> str | None:
        """The pipe directory of the GPU's server (None: that GPU has no MPS)."""
        gpu = self.running.get(uuid or "")
        return None if gpu is None else str(gpu.pipe)

    def describe(self, uuid: str | None) -> str:
        """How the lanes of the GPU `uuid` (None: a CPU device) share it, for status."""
        if uuid is None:
            return "lanes run in parallel processes on the CPU's cores"
        if uuid in self.running:
            return "MPS: the lanes' processes run their kernels concurrently"
        why = self.problem or "salusd serve --mps not given"
        return f"time-shared at iteration boundaries (no MPS: {why})"

    def stop(self) -> None:
        """Ask every running control daemon to quit (its servers end with it)."""
        for uuid, gpu in list(self.running.items()):
            try:
                self._run([self.control or CONTROL], input="quit\n",
                          env=gpu.environment(dict(os.environ)), capture_output=True,
                          text=True, timeout=START_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("could not stop the MPS control daemon of %s: %s", uuid, exc)
            else:
                (gpu.pipe.parent / PID_FILE).unlink(missing_ok=True)
            del self.running[uuid]


def stale_homes(root: Path) -> list[Path]:
    """The GPU directories (`<root>/mps/<uuid>`) an earlier salusd may have left a control
    daemon in: under `root`, and, where `root` is a temporary `salusd-<pid>`, under the
    temporary roots of this user's salusd processes that are gone."""
    roots = [root]
    if _TEMP_ROOT.fullmatch(root.name) and root.parent.is_dir():
        for other in sorted(root.parent.iterdir()):
            found = _TEMP_ROOT.fullmatch(other.name)
            if found and other != root and _mine(other) and not _alive(int(found[1])):
                roots.append(other)
    return [home for r in roots if (r / "mps").is_dir() for home in sorted((r / "mps").iterdir())
            if home.is_dir() and ((home / "pipe").is_dir() or (home / PID_FILE).exists())]


def control_pid(pipe: Path, proc: Path = Path("/proc")) -> int | None:
    """The pid of the control daemon serving `pipe`: the process named after the control
    program whose environment names that pipe directory (None: not found)."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != CONTROL[:15]:  # comm keeps 15 bytes
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    return None


def _recorded_pid(home: Path) -> int | None:
    """The pid recorded in `home`, if that process is still a control daemon (a pid may have
    been reused since)."""
    try:
        pid = int((home / PID_FILE).read_text())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    return pid if comm == CONTROL[:15] else None


def _mine(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] != "Z"


def _ended(pid: int, within_s: float) -> bool:
    """Whether `pid` ends within `within_s` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
