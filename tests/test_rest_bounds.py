"""The REST port under idle connections and load, against the real daemon: connections that
send nothing or part of a request head are bounded in time (and, under pressure, in number per
client), /healthz answers throughout, and a burst of authenticated requests is served rather
than refused."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import pytest
from daemon_proc import salusd, wait_until
from fastapi import FastAPI

from salus.daemon.rest.connections import ConnectionGuard
from salus.daemon.rest.server import MAX_HEAD_BYTES, RestServer


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def _burst(url: str, token: str, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        replies = await asyncio.gather(*(client.get("/v1/jobs") for _ in range(n)),
                                       return_exceptions=True)
    return [r.status_code if isinstance(r, httpx.Response) else 0 for r in replies]


@pytest.mark.slow
def test_idle_connections_neither_block_healthz_nor_the_api(tmp_path: Path) -> None:
    with salusd(tmp_path, "--http", "127.0.0.1:0", devices=1):
        state = tmp_path / "state"
        url = (state / "http.url").read_text().strip()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        idle = []
        try:
            for i in range(260):  # half send nothing, half one header line and no more
                sock = socket.create_connection((host, int(port)), timeout=5)
                if i % 2:
                    sock.sendall(b"GET /v1/jobs HTTP/1.1\r\n")
                idle.append(sock)
            until = time.monotonic() + 3.0  # 260 is below the pressure mark: none is cut early
            probes = 0
            while time.monotonic() < until:
                started = time.monotonic()
                reply = httpx.get(f"{url}/healthz", timeout=2.0)
                assert reply.status_code == 200, reply.text
                assert time.monotonic() - started < 2.0
                probes += 1
                time.sleep(0.1)
            assert probes >= 10
            wait_until(lambda: all(_closed_by_server(s) for s in idle), 30,
                       "the 10 s head timeout to close every idle connection")
            token = (state / "admin.token").read_text().strip()
            codes = asyncio.run(_burst(url, token, 500))
            served = codes.count(200)
            assert served >= 475, f"{served} of 500 served; codes {sorted(set(codes))}"
            assert httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
        finally:
            for sock in idle:
                sock.close()


def test_a_connection_without_a_request_is_closed_and_heads_are_bounded() -> None:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    server = RestServer(app, "127.0.0.1", 0, guard=ConnectionGuard(head_timeout_s=0.5))
    server.start()
    try:
        silent = socket.create_connection((server.host, server.port), timeout=5)
        partial = socket.create_connection((server.host, server.port), timeout=5)
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        wait_until(lambda: _closed_by_server(silent) and _closed_by_server(partial), 10,
                   "the sweep (every second) to close both")
        big = socket.create_connection((server.host, server.port), timeout=5)
        big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEAD_BYTES)
        assert big.recv(64).startswith(b"HTTP/1.1 400")
        assert httpx.get(f"{server.url}/healthz", timeout=2.0).status_code == 200
        for sock in (silent, partial, big):
            sock.close()
    finally:
        server.stop()


class _Conn:
    """What `ConnectionGuard` uses of a connection: its client, transport and loop (whose
    clock reads `now`)."""

    def __init__(self, client: str, now: float = 0.0) -> None:
        self.client = client
        self.now = now
        self.closed = False
        self.transport = self
        self.loop = self

    def client_host(self) -> str:
        return self.client

    def close(self) -> None:
        self.closed = True

    def call_later(self, *_: object) -> None:
        pass

    def time(self) -> float:
        return self.now


def _admit(guard: ConnectionGuard, client: str, now: float, n: int) -> list[_Conn]:
    conns = [_Conn(client) for _ in range(n)]
    for conn in conns:
        assert guard.admit(conn, now)  # type: ignore[arg-type]
    return conns


def test_a_client_is_bounded_only_when_the_slots_are_wanted() -> None:
    guard = ConnectionGuard(max_connections=16, max_idle_per_client=2, grace_s=1.0)
    slow = _admit(guard, "a", 0.0, 7)  # a client whose requests come late; the mark is 8
    guard._sweep(_Conn("loop", now=5.0))  # type: ignore[arg-type]
    _admit(guard, "a", 5.0, 1)
    _admit(guard, "b", 5.0, 1)
    assert not any(c.closed for c in slow)
    guard._sweep(_Conn("loop", now=5.0))  # type: ignore[arg-type]  # 9 open: "a" keeps 2 idle
    assert [c.closed for c in slow] == [True] * 5 + [False] * 2
    assert len(guard.open) == 4

    guard = ConnectionGuard(max_connections=8, max_idle_per_client=1, grace_s=1.0)
    slow = _admit(guard, "a", 0.0, 4)
    _admit(guard, "a", 5.0, 1)  # 4 open, the mark: connecting again costs "a" its oldest
    assert [c.closed for c in slow] == [True, False, False, False]


def test_at_the_maximum_the_longest_idle_goes_and_all_busy_refuses() -> None:
    guard = ConnectionGuard(max_connections=4, max_idle_per_client=4, grace_s=1.0)
    conns = _admit(guard, "a", 0.0, 2) + _admit(guard, "b", 0.5, 2)
    newest = _Conn("c")
    assert guard.admit(newest, 2.0)  # type: ignore[arg-type]
    assert [c.closed for c in conns] == [True, False, False, False]
    for conn in (*conns[1:], newest):
        guard.busy(conn)  # type: ignore[arg-type]
    assert not guard.admit(_Conn("d"), 3.0)  # type: ignore[arg-type]
    guard.idle(conns[2], 3.0)  # type: ignore[arg-type]
    assert guard.admit(_Conn("d"), 4.5)  # type: ignore[arg-type]
    assert conns[2].closed
