"""Bounds on the REST port's connections, which uvicorn alone does not give.

uvicorn's `limit_concurrency` counts open connections as well as requests, and nothing times
out a connection before its first request: 260 connections that send nothing (or one header
line) made every later request, `/healthz` included, a 503 for as long as they stayed open. So
the HTTP server runs uvicorn's h11 protocol with a `ConnectionGuard`, which

- closes a connection that has no request in flight (it sent nothing, part of a request head,
  or is idle after a response) for over `head_timeout_s` seconds; between requests uvicorn's
  own `timeout_keep_alive` closes it sooner;
- once the server holds `pressure_connections` (half of `max_connections`) or more, keeps at
  most `max_idle_per_client` such connections per client address, checked when a client
  connects and every second: a client over it loses its longest-idle ones older than `grace_s`.
  Below that nobody needs the slots, so nothing is evicted early: a busy client's burst of
  hundreds of connections whose requests arrive seconds after the connect (its own event loop
  behind) is served, not cut off; `head_timeout_s` still ends connections that never send a
  request. On loopback every local user is one client, so this bounds idle connections in all
  rather than one user's: what keeps the port usable there is that idle connections are
  evicted, never the new one;
- holds at most `max_connections` in all: one more evicts the longest-idle connection, and is
  closed at once when every connection has a request in flight.

A request in flight is never evicted; how many run at once is `RequestLimit`'s business
(`app.py`), which serves `/healthz` ahead of it. Times are seconds, on the event loop's clock.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("salusd.rest")
_BUSY_TEXT = b"salusd's HTTP server is at its connection limit, every one busy; try again\n"
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close"
            b"\r\ncontent-length: " + str(len(_BUSY_TEXT)).encode() + b"\r\n\r\n" + _BUSY_TEXT)


class ConnectionGuard:
    """The open connections of one HTTP server and the bounds above."""

    def __init__(self, *, max_connections: int = 1024, max_idle_per_client: int = 32,
                 head_timeout_s: float = 10.0, grace_s: float = 1.0) -> None:
        self.max_connections = max_connections
        self.max_idle_per_client = max_idle_per_client
        self.pressure_connections = max_connections // 2
        self.head_timeout_s = head_timeout_s
        self.grace_s = grace_s
        self.open: dict[GuardedH11Protocol, float] = {}  # connection -> idle since
        self.evicted = 0
        self._sweeping = False

    def admit(self, conn: GuardedH11Protocol, now: float) -> bool:
        """Register a new connection; False when it must be closed (all are busy)."""
        self._sweep_soon(conn)
        if not self._under_pressure():  # nobody wants the slots (the maximum is above)
            self.open[conn] = now
            return True
        client = conn.client_host()
        idle = self._idle(now)
        mine = [c for c in idle if c.client_host() == client]
        if len(mine) >= self.max_idle_per_client:
            self._evict(mine[0], "its client holds too many idle connections")
        if len(self.open) >= self.max_connections:
            oldest = next((c for c in idle if c in self.open), None)
            if oldest is None:
                log.warning("refusing an HTTP connection from %s: %d connections, all with a "
                            "request in flight", client, len(self.open))
                return False
            self._evict(oldest, "the server holds its maximum of connections")
        self.open[conn] = now
        return True

    def busy(self, conn: GuardedH11Protocol) -> None:
        """`conn` has a request in flight."""
        if conn in self.open:
            self.open[conn] = float("inf")

    def idle(self, conn: GuardedH11Protocol, now: float) -> None:
        """`conn` answered its request and waits for the next."""
        if conn in self.open:
            self.open[conn] = now

    def gone(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)

    def _idle(self, now: float) -> list[GuardedH11Protocol]:
        """Connections without a request in flight, idle for over `grace_s`, longest first."""
        return sorted((c for c, since in self.open.items() if now - since > self.grace_s),
                      key=self.open.__getitem__)

    def _evict(self, conn: GuardedH11Protocol, why: str) -> None:
        self.evicted += 1
        log.debug("closing an idle HTTP connection from %s: %s", conn.client_host(), why)
        self.open.pop(conn, None)
        conn.transport.close()

    def _sweep_soon(self, conn: GuardedH11Protocol) -> None:
        if not self._sweeping:
            self._sweeping = True
            conn.loop.call_later(1.0, self._sweep, conn.loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every second: close connections idle for over `head_timeout_s`, and under pressure
        each client's longest-idle ones beyond `max_idle_per_client`."""
        now = loop.time()
        for conn, since in list(self.open.items()):
            if now - since > self.head_timeout_s:
                self._evict(conn, f"no request within {self.head_timeout_s:g} s")
        if self._under_pressure():
            self._bound_clients(now)
        self._sweeping = bool(self.open)
        if self._sweeping:
            loop.call_later(1.0, self._sweep, loop)

    def _under_pressure(self) -> bool:
        return len(self.open) >= self.pressure_connections

    def _bound_clients(self, now: float) -> None:
        per_client: dict[str, list[GuardedH11Protocol]] = {}
        for conn in self._idle(now):
            per_client.setdefault(conn.client_host(), []).append(conn)
        for idle in per_client.values():
            for conn in idle[: max(0, len(idle) - self.max_idle_per_client)]:
                self._evict(conn, "its client holds too many idle connections")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol reporting to a `ConnectionGuard` (set per server by `guarded`)."""

    guard: ConnectionGuard

    def client_host(self) -> str:
        return self.client[0] if self.client else "?"

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if not self.guard.admit(self, self.loop.time()):
            transport.write(_REFUSED)
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.gone(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self.guard.busy(self)

    def on_response_complete(self) -> None:
        self.guard.idle(self, self.loop.time())
        super().on_response_complete()


def guarded(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`) for connections under `guard`."""
    return type("Guarded", (GuardedH11Protocol,), {"guard": guard})
