"""uvicorn on a thread of the daemon, on a socket bound before the daemon reports ready (so a
busy port is a clear start-up error, and port 0 picks a free one)."""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("salusd.rest")


def parse_listen(text: str) -> tuple[str, int] | None:
    """`127.0.0.1:7077` → (host, port); `none` → None. ValueError says what is wrong."""
    if text.strip().lower() == "none":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http wants HOST:PORT or 'none', got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class RestServer:
    def __init__(self, app: FastAPI, host: str, port: int, *,
                 max_connections: int = 256) -> None:
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
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                limit_concurrency=max_connections, timeout_keep_alive=5,
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
