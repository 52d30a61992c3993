"""uvicorn on a thread of the daemon, on a socket bound before the daemon reports ready (so a
busy port is a clear start-up error, and port 0 picks a free one).

What bounds the port, and why (an idle connection costs a slot, so each is bounded in time and
number; a request in flight is never cut off):

- `connections.ConnectionGuard` over uvicorn's h11 protocol: a connection with no request in
  flight is closed after `head_timeout_s` (10 s: a request head arrives in milliseconds, so
  this only ends idle or stalled ones); once half the slots are taken a client address keeps
  at most `max_idle_per_client` (32) idle connections, its longest-idle one closed when it
  opens more; `max_connections`
  (1024) in all, well under the daemon's descriptor limit. uvicorn has no per-client bound:
  this guard is it. On loopback all local users are one address; there the eviction of idle
  connections (never of the newest) is what keeps the port answering.
- `timeout_keep_alive=5`: an idle keep-alive connection closes 5 s after its last response.
- `h11_max_incomplete_event_size=16 KiB`: h11 buffers at most 16 KiB of a request head that
  has not ended (400 beyond it), so a head sent slowly cannot grow; bodies are at most 64 KiB
  (`app.BodyLimit`, 413).
- `limit_concurrency` is off: uvicorn counts idle connections against it, which let 256 idle
  connections answer every request, `/healthz` included, with 503. Instead `app.RequestLimit`
  runs at most 64 requests at once and queues the rest; `/healthz` is answered ahead of it.
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI

from salus.daemon.rest.connections import ConnectionGuard, guarded

log = logging.getLogger("salusd.rest")
MAX_HEAD_BYTES = 16 * 1024


class RestServer:
    def __init__(self, app: FastAPI, host: str, port: int, *,
                 guard: ConnectionGuard | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
        self.sock.listen(1024)
        self.host, self.port = self.sock.getsockname()[:2]
        self.guard = guard or ConnectionGuard()
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=guarded(self.guard), timeout_keep_alive=5,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="salusd-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except Exception:
            log.exception("the HTTP server stopped")

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
