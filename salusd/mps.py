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
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` set to the device's budget in salusd's ledger: no client
can take memory the ledger gave to something else on the GPU.

The trade-offs (docs/runtime.md): a fatal fault in one client (an illegal memory access) brings
down the GPU's MPS server and with it every client on that GPU, where without MPS it costs
only its own process; and a control daemon serves one user's clients at a time (legacy MPS
starts a server per uid and makes a client of another uid wait until the running server's
clients are gone), so admission places one owner's jobs at a time on an MPS GPU
(`salus.scheduler.mps`) and MPS pays only on a GPU whose jobs are one owner's. salusd therefore
starts MPS only when asked (`salusd serve --mps`), never by default, even as root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from salus.daemon.devices import DeviceSpec

log = logging.getLogger("salusd.mps")

CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 30.0

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
        for uuid, gpu in self.gpus.items():
            self._stop_stale(gpu)
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
            log.info("MPS control daemon started for %s (pipes in %s)", uuid, gpu.pipe)
        if self.problem is not None:
            log.error("MPS not used: %s", self.problem)
            self.stop()

    def _stop_stale(self, gpu: MpsGpu) -> None:
        """A control daemon left by a salusd that was killed (its pipe is still there) is
        asked to quit before a new one starts."""
        if not (gpu.pipe / "control").exists():
            return
        log.warning("stopping the MPS control daemon a previous salusd left on %s", gpu.uuid)
        try:
            self._run([self.control or CONTROL], input="quit\n",
                      env=gpu.environment(dict(os.environ)), capture_output=True, text=True,
                      timeout=START_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not stop it: %s", exc)

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
            del self.running[uuid]
