"""Every input is bounded, and bad input gets a clear error for its sender alone: the real
`salusd serve` process under slow frames, bursts of connections, huge counts, hostile names."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_proc import RunningDaemon, rss, salusd
from torch import nn

import salus.adapters.torch as salus
from salus.adapters.torch import transport
from salus.daemon.cli.control import Control
from salus.daemon.wire.errors import BadRequest, Busy, JobCancelled
from salus.daemon.wire.frames import FIXED, MAGIC, VERSION, FrameReader, json_frame

pytestmark = pytest.mark.slow


def _raw(path: str, message: object) -> dict[str, object]:
    """One JSON request on a fresh connection, bypassing the adapter's own checks."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"".join(json_frame(message).buffers()))
        reader = FrameReader(s)
        while True:
            frames, closed = reader.read(0.0)
            if frames:
                reply = frames[0].json()
                assert isinstance(reply, dict)
                return reply
            assert not closed, "the daemon hung up instead of answering"


def _train(address: str, steps: int = 5) -> float:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    with salus.connect(name="bystander", iterations=steps, address=address) as job:
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
        return min(step(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(steps))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """One daemon with the default bounds (and a REST API) for the tests that need no other:
    each leaves it serving, and checks that it does."""
    with salusd(tmp_path_factory.mktemp("salusd"), "--http", "127.0.0.1:0") as daemon:
        yield daemon


def test_slow_frames_pin_nothing_and_are_dropped_at_the_deadline(tmp_path: Path) -> None:
    with salusd(tmp_path, "--frame-timeout", "2") as (proc, address):
        path = address.removeprefix("unix://")
        before = rss(proc.pid)
        slow = []
        for _ in range(32):  # each announces a 64 MiB frame and sends 1 KiB of it
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(FIXED.pack(MAGIC, VERSION, 0, 0, 64, 64 * 2**20 - 64) + bytes(1024))
            slow.append(s)
        assert _train(address) < 10  # others are served meanwhile
        grown = rss(proc.pid) - before
        assert grown < 32 * 2**20, f"slow frames pinned {grown} bytes"
        for s in slow:  # dropped by the 2 s deadline: the daemon closes them
            s.settimeout(10)
            assert s.recv(1) == b""
            s.close()
        assert proc.poll() is None


def test_two_hundred_connections_at_once_are_all_served(shared: RunningDaemon) -> None:
    proc, address = shared
    errors: list[BaseException] = []
    ready = threading.Barrier(200)

    def client(i: int) -> None:
        try:
            ready.wait(timeout=60)
            with salus.connect(name=f"burst{i}", iterations=1, address=address,
                               timeout_s=60) as job:
                assert job.info()["name"] == f"burst{i}"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert proc.poll() is None


def test_a_connection_over_the_limit_gets_a_clear_refusal(tmp_path: Path) -> None:
    with salusd(tmp_path, "--max-connections", "3") as (proc, address):
        held = [Control(address) for _ in range(3)]
        with pytest.raises(Busy, match="at most 3 connections"):
            Control(address)
        with pytest.raises(Busy, match="at most 3 connections"):  # a script is told alike
            salus.connect(name="one-too-many", iterations=1, address=address)
        held.pop().close()
        time.sleep(0.2)
        with Control(address) as ctl:  # a place came free
            assert ctl.status()["policy"] == "pack"
        for c in held:
            c.close()


def test_huge_counts_and_hostile_names_are_refused_and_status_stays_readable(
        tmp_path: Path) -> None:
    with salusd(tmp_path, "--policy", "srtf", "--http", "127.0.0.1:0") as (proc, address):
        path = address.removeprefix("unix://")
        with pytest.raises(ValueError, match="2\\*\\*53"):
            salus.connect(name="huge", iterations=10**400, address=address)
        for iterations in (10**400, 2**53 + 1, 0, -1, 1.5, True, "7"):
            reply = _raw(path, {"op": "open", "name": "huge", "iterations": iterations})
            assert reply["ok"] is False and reply["code"] == "bad_request", reply
        for name in ("\ud800", "evil\x1b[31mred", "bell\x07", "a" * 201, "", "zero\u200bwidth"):
            with pytest.raises(BadRequest):
                salus.connect(name=name, iterations=5, address=address)
        with salus.connect(name="fine [bold]name[/bold] ☃", iterations=2**53,
                           address=address) as job:
            status = subprocess.run(
                [sys.executable, "-m", "salus.daemon.cli", "status", "--state-dir",
                 str(tmp_path / "state")],
                capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
            assert status.returncode == 0, status.stderr
            assert "[bold]name[/bold]" in status.stdout  # shown as text, not markup
            assert "\x1b[31m" not in status.stdout
            assert job.info()["iterations_planned"] == 2**53
        assert _train(address) < 10  # srtf with the largest count still schedules
        assert proc.poll() is None


def test_an_ended_job_answers_with_its_end_state_not_unknown(shared: RunningDaemon) -> None:
    proc, address = shared
    model = nn.Linear(4, 2)
    job = salus.connect(name="ends", iterations=10, address=address)
    step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    step(torch.randn(2, 4), torch.randn(2, 2))
    with Control(address) as ctl:
        ctl.cancel(job.id)
        info = ctl.info(job.id)
    assert info["state"] == "cancelled" and "was cancelled" in info["reason"]
    with pytest.raises(JobCancelled, match="cancelled"):
        step(torch.randn(2, 4), torch.randn(2, 2))
    job.close()


def _until_closed(s: socket.socket) -> bytes:
    """Everything the peer sends until it closes the connection."""
    data = b""
    while True:
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            return data
        if not got:
            return data
        data += got


def test_garbage_and_oversized_frames_cost_only_their_sender(shared: RunningDaemon) -> None:
    proc, address = shared
    path = address.removeprefix("unix://")
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
        s.settimeout(5)
        said = _until_closed(s)  # dropped after one error reply: not a salusd frame
        assert b"not a salusd frame" in said, said
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(FIXED.pack(MAGIC, VERSION, 0, 0, 64, 2**40))
        s.settimeout(5)
        said = _until_closed(s)  # over the frame limit
        assert b'"too_large"' in said and b"exceeds the" in said, said
    reply = _raw(path, {"op": "no-such-op"})
    assert reply["code"] == "bad_request" and "unknown op" in str(reply["message"])
    reply = _raw(path, ["not", "an", "object"])
    assert reply["code"] == "bad_request"
    assert _train(address) < 10
    assert proc.poll() is None
    assert os.path.exists(path)


def test_a_job_over_the_queue_bound_is_told_to_wait(shared: RunningDaemon,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor answers `busy` past 64 queued calls (a client that does not bound its
    calls in flight); the adapter keeps at most `MAX_IN_FLIGHT` in flight, so its calls never
    meet that bound."""
    proc, address = shared
    with salus.connect(name="eager", iterations=10, address=address) as job:
        remote = job.attach(model=nn.Linear(4, 2))

        @remote.iteration
        def slow(s: object, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x

        def outcomes() -> list[str]:
            futures = [slow.submit(torch.zeros(1)) for _ in range(70)]
            seen = []
            for f in futures:
                try:
                    f.result()
                    seen.append("ok")
                except Busy:
                    seen.append("busy")
            return seen

        with monkeypatch.context() as patched:  # first, before the job holds a lease
            patched.setattr(transport, "MAX_IN_FLIGHT", 100)
            seen = outcomes()
        assert "busy" in seen and seen.count("ok") >= 64
        assert outcomes() == ["ok"] * 70
    assert proc.poll() is None


def test_peer_credentials_name_the_owner(shared: RunningDaemon) -> None:
    with Control(shared.address) as ctl:
        import pwd

        assert ctl.owner == pwd.getpwuid(os.getuid()).pw_name
        struct.calcsize("3i")  # SO_PEERCRED's (pid, uid, gid)


def test_the_operators_status_finds_the_daemon_by_salus_address_alone(
        shared: RunningDaemon, tmp_path: Path) -> None:
    """`salusd status` with only `SALUS_ADDRESS` set (no --url, --state-dir, SALUS_URL; a HOME
    without a default state dir) asks the daemon at that socket where its REST API is."""
    env = {k: v for k, v in os.environ.items() if k not in ("SALUS_URL", "SALUS_TOKEN")}
    env.update(HOME=str(tmp_path / "home"), COLUMNS="400",
               XDG_STATE_HOME=str(tmp_path / "home" / "state"))
    address = shared.address
    with salus.connect(name="found-by-socket", iterations=3, address=address):
        status = subprocess.run([sys.executable, "-m", "salus.daemon.cli", "status"],
                                capture_output=True, text=True, timeout=60,
                                env={**env, "SALUS_ADDRESS": address})
        assert status.returncode == 0, status.stderr
        assert "found-by-socket" in status.stdout
