"""The daemon process: wires the I/O loop, the executor supervisor, the engine and the socket
front end together, runs until asked to stop, and stops gracefully.

This process never imports torch and never runs or unpickles job code (`docs/runtime.md`).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from salus.daemon.devices import DeviceSpec
from salus.daemon.engine.engine import Engine
from salus.daemon.executor.supervisor import Supervisor
from salus.daemon.frontend.handlers import Handlers
from salus.daemon.frontend.loop import Loop
from salus.daemon.frontend.server import SocketServer

log = logging.getLogger("salusd")


@dataclass(frozen=True)
class DaemonConfig:
    """What `salusd serve` was asked for (bytes, seconds)."""

    socket_path: str
    devices: Sequence[DeviceSpec]
    policy: str = "pack"
    threads: int = 1
    group: str | None = None
    max_connections: int = 1024
    frame_timeout_s: float = 30.0
    cancel_grace_s: float = 5.0
    retention_s: float = 3600.0
    standby_executors: int = 2
    shutdown_timeout_s: float = 60.0


class Daemon:
    """One salusd: build with a config, `start()`, then `run()` until `request_stop()`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.loop = Loop(time.monotonic)
        self.supervisor = Supervisor(self.loop, standby=config.standby_executors,
                                     threads=config.threads)
        self.engine = Engine(
            [d.memory_bytes for d in config.devices], config.policy, self.supervisor,
            clock=time.monotonic, timers=self.loop,
            torch_devices=[d.torch_device for d in config.devices], threads=config.threads,
            retention_s=config.retention_s, cancel_grace_s=config.cancel_grace_s)
        self.supervisor.on_reply = self.engine.on_executor_reply
        self.supervisor.on_died = self.engine.on_executor_died
        self.server = SocketServer(config.socket_path, self.loop, Handlers(self.engine),
                                   group=config.group, max_connections=config.max_connections,
                                   frame_timeout_s=config.frame_timeout_s)
        self._stop = False

    def start(self) -> None:
        """Start the executor zygote (it imports torch once), then listen."""
        self.supervisor.start()
        self.supervisor.wait_ready()
        self.server.start()

    def request_stop(self) -> None:
        """Safe from a signal handler or another thread."""
        self.loop.call_soon_threadsafe(self._begin_stop)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())

    def run(self) -> None:
        """Serve until stopped; then let running calls finish and answer, and clean up."""
        while not self._stop:
            self.loop.run_once()
        log.info("shutting down: running calls finish, queued calls are refused")
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while not self.engine.idle and time.monotonic() < deadline:
            self.loop.run_once(0.1)
        flush_deadline = time.monotonic() + 2.0
        while any(link.out for link in self.loop.links) and time.monotonic() < flush_deadline:
            self.loop.run_once(0.05)
        self.supervisor.stop()
        self.loop.shutdown()
        log.info("stopped")

    def _begin_stop(self) -> None:
        if self._stop:
            return
        self._stop = True
        self.server.stop()
        self.engine.begin_shutdown()
