"""The unix-socket data plane end to end: real sockets, threads and a client process, with a
small JobService that trains synchronously (the transport's test double; the executor is
tested elsewhere)."""

from __future__ import annotations

import contextlib
import grp
import itertools
import json
import os
import pickle
import pwd
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

import salus.adapters.torch as salus
from salus.daemon.errors import JobFailed, NotOwner, UnknownJob
from salus.daemon.ipc import compact
from salus.daemon.ipc.handlers import RequestHandler
from salus.daemon.ipc.server import SocketServer
from salus.daemon.ipc.wire import (
    FLAG_COMPACT,
    MAGIC,
    VERSION,
    Channel,
    ConnectionClosed,
    FrameTooLarge,
)


class LocalService:
    """JobService that runs every iteration at once in the calling thread."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.closed: list[str] = []
        self.closed_changed = threading.Condition(self._lock)

    def _job(self, job_id: str, owner: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"no job {job_id!r}")
        if job["owner"] != owner:
            raise NotOwner(f"job {job_id} belongs to {job['owner']}")
        return job

    def open_job(self, owner: str, name: str, iterations: int, kind: str) -> str:
        with self._lock:
            job_id = str(next(self._ids))
            self.jobs[job_id] = {"owner": owner, "name": name, "kind": kind, "done": 0}
        return job_id

    def setup_training(self, job_id: str, owner: str, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer,
                       loss_fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
        self._job(job_id, owner).update(model=model, optimizer=optimizer, loss_fn=loss_fn)
        return {"persistent_bytes": sum(p.numel() * p.element_size()
                                        for p in model.parameters())}

    def setup_inference(self, job_id: str, owner: str, model: torch.nn.Module) -> dict[str, Any]:
        self._job(job_id, owner)["model"] = model
        return {"persistent_bytes": 0}

    def step(self, job_id: str, owner: str, inputs: torch.Tensor,
             target: torch.Tensor) -> Future[float]:
        job = self._job(job_id, owner)
        done: Future[float] = Future()
        try:
            job["optimizer"].zero_grad()
            loss = job["loss_fn"](job["model"](inputs), target)
            loss.backward()
            job["optimizer"].step()
            job["done"] += 1
            done.set_result(float(loss.detach()))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def infer(self, job_id: str, owner: str, inputs: torch.Tensor) -> Future[torch.Tensor]:
        done: Future[torch.Tensor] = Future()
        with torch.no_grad():
            done.set_result(self._job(job_id, owner)["model"](inputs))
        return done

    def state_dict(self, job_id: str, owner: str) -> dict[str, torch.Tensor]:
        model = self._job(job_id, owner)["model"]
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def job_info(self, job_id: str, owner: str) -> dict[str, Any]:
        job = self._job(job_id, owner)
        return {"id": job_id, "name": job["name"], "kind": job["kind"], "done": job["done"]}

    def close_job(self, job_id: str, owner: str) -> None:
        self._job(job_id, owner)
        with self._lock:
            del self.jobs[job_id]
            self.closed.append(job_id)
            self.closed_changed.notify_all()

    def wait_closed(self, job_id: str, timeout_s: float = 30.0) -> bool:
        with self._lock:
            return self.closed_changed.wait_for(lambda: job_id in self.closed, timeout_s)


@pytest.fixture
def service() -> LocalService:
    return LocalService()


@pytest.fixture
def short_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="salus-", dir="/tmp") as path:
        yield path


@pytest.fixture
def server(service: LocalService, short_dir: str) -> Iterator[SocketServer]:
    srv = SocketServer(os.path.join(short_dir, "salusd.sock"), service,
                       max_frame_bytes=64 * 1024)
    srv.start()
    yield srv
    srv.stop()


def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batches(n: int, rows: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 2, generator=g))
            for _ in range(n)]


def train_locally(model: torch.nn.Module, make_opt: Callable[..., torch.optim.Optimizer],
                  data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    optimizer, losses = make_opt(model.parameters()), []
    for x, y in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def raw_client(server: SocketServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(server.path)
    return sock


def test_socket_file_mode_group_and_removal(service: LocalService, short_dir: str) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    path = os.path.join(short_dir, "sub", "s.sock")
    srv = SocketServer(path, service, group=group)
    srv.start()
    try:
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == os.getgid()
        assert srv.address == f"unix://{path}"
        with pytest.raises(RuntimeError, match="already listening"):
            SocketServer(path, service).start()
    finally:
        srv.stop()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="unknown group"):
        SocketServer(path, service, group="no-such-group-salus")
    with pytest.raises(ValueError, match="longer than"):
        SocketServer("/tmp/" + "x" * 120, service)


def test_stale_socket_is_replaced(service: LocalService, short_dir: str) -> None:
    path = os.path.join(short_dir, "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a file nobody listens on, as a killed daemon leaves it
    with SocketServer(path, service) as srv, salus.connect("j", 1, address=srv.address) as job:
        assert job.owner == pwd.getpwuid(os.getuid()).pw_name


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
], ids=["sgd", "adam"])
def test_training_through_the_daemon_matches_local_training(
    server: SocketServer, make_opt: Callable[..., torch.optim.Optimizer]
) -> None:
    data = batches(20)
    reference = make_mlp(0)
    local_losses = train_locally(reference, make_opt, data)
    model = make_mlp(0)
    with salus.connect(name="mlp", iterations=len(data), address=server.address) as job:
        step = job.train_step(model, make_opt(model.parameters()),
                              torch.nn.functional.mse_loss)
        losses = [step(x, y) for x, y in data]
        state = job.state_dict()
        assert job.info()["done"] == len(data)
    assert losses == pytest.approx(local_losses, abs=1e-6)
    for name, value in reference.state_dict().items():
        assert state[name].device.type == "cpu"
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)


def in_memfd_mapping(t: torch.Tensor) -> bool:
    with open("/proc/self/maps") as f:
        spans = [[int(v, 16) for v in line.split()[0].split("-")]
                 for line in f if "memfd:salus-tensors" in line]
    return any(lo <= t.data_ptr() < hi for lo, hi in spans)


def test_inference_and_large_batches_use_shared_memory(server: SocketServer) -> None:
    model = make_mlp(3)
    x = torch.randn(40_000, 8)  # 1.28 MB in, 320 KB out: both cross in shared memory
    with salus.connect(name="serve", iterations=2, address=server.address) as job:
        infer = job.inference(model)
        out = infer(x)
        again = infer(x[:4])
        inputs = [torch.randn(5, 8) for _ in range(40)]
        outputs: dict[int, torch.Tensor] = {}

        def worker(first: int) -> None:  # four threads share the job: calls must not mix
            for i in range(first, len(inputs), 4):
                outputs[i] = infer(inputs[i])

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert in_memfd_mapping(out) and not in_memfd_mapping(again)
    with torch.no_grad():
        for i, inp in enumerate(inputs):
            torch.testing.assert_close(outputs[i], model(inp))
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(again, model(x[:4]))


@contextlib.contextmanager
def steady_training(server: SocketServer, seed: int) -> Iterator[None]:
    """A client training in the background while the body attacks the server; afterwards its
    losses must equal training locally."""
    data = batches(40)
    reference = make_mlp(seed)
    local_losses = train_locally(reference, lambda ps: torch.optim.SGD(ps, lr=0.1), data)
    model = make_mlp(seed)
    losses: list[float] = []
    with salus.connect("steady", len(data), address=server.address) as job:
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              torch.nn.functional.mse_loss)
        thread = threading.Thread(target=lambda: losses.extend(step(x, y) for x, y in data))
        thread.start()
        yield
        thread.join(60)
    assert losses == pytest.approx(local_losses, abs=1e-6)


def test_garbage_on_one_connection_does_not_disturb_another(server: SocketServer) -> None:
    with steady_training(server, 5):
        for _ in range(5):
            garbage = raw_client(server)
            garbage.sendall(b"GET / HTTP/1.1\r\nHost: salusd\r\n\r\n" + os.urandom(512))
            reply = Channel(garbage).recv()  # one error reply, then the daemon hangs up
            assert reply["ok"] is False and reply["code"] == "bad_frame"
            assert garbage.recv(1) == b""
            garbage.close()
            confused = Channel(raw_client(server))  # well framed, nonsense inside: kept open
            for bad in ({"op": "fly"}, {"op": "step", "job": 5}, [1, 2], {"op": "open"}):
                confused.send(bad)
                assert confused.recv()["code"] == "bad_request"
            confused.send({"op": "ping"})
            assert confused.recv()["ok"] is True
            confused.close()


def raw_frame(header: bytes, body: bytes = b"") -> bytes:
    header += b" " * (-len(header) % 64)
    return struct.pack("<4sBBHIQ", MAGIC, VERSION, 0, 0, len(header), len(body)) + header + body


def test_bad_payloads_get_error_replies_and_keep_the_connection(server: SocketServer) -> None:
    channel = Channel(raw_client(server))
    channel.send({"op": "open", "name": "raw", "iterations": 1, "kind": "training"})
    job_id = channel.recv()["result"]["job"]
    cases = [
        (b"not a pickle", "bad_request", "could not unpickle"),
        (b"cno_such_module_salus\nThing\n.", "bad_request", "no_such_module_salus"),
        (pickle.dumps((1, 2)), "bad_request", "tuple"),
    ]
    for blob, code, words in cases:
        head = json.dumps({"op": "setup_training", "job": job_id, "objects": {
            "$": "p", "data": {"$": "b", "len": len(blob), "seg": 0, "off": 0},
            "storages": []}}).encode()
        channel.sock.sendall(raw_frame(head, blob))
        reply = channel.recv()
        assert (reply["code"], words in reply["message"]) == (code, True), reply
    bad_tensor = {"op": "step", "job": job_id,
                  "x": {"$": "t", "dtype": "float32", "shape": [1000], "seg": 0, "off": 0}}
    channel.sock.sendall(raw_frame(json.dumps(bad_tensor).encode(), bytes(64)))
    reply = channel.recv()
    assert reply["code"] == "bad_frame" and "runs past the end" in reply["message"]
    channel.send({"op": "info", "job": job_id})
    assert channel.recv()["ok"] is True
    channel.close()


def test_client_process_killed_mid_job_gets_its_job_closed(
    server: SocketServer, service: LocalService
) -> None:
    script = textwrap.dedent("""
        import os, sys, torch
        import salus.adapters.torch as salus

        class Net(torch.nn.Module):  # lives in __main__: shipped by value
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 1)

            def forward(self, x):
                return self.fc(x)

        job = salus.connect("doomed", 1000)
        net = Net()
        step = job.train_step(net, torch.optim.SGD(net.parameters(), lr=0.1),
                              torch.nn.functional.mse_loss)
        step(torch.randn(8, 4), torch.randn(8, 1))
        print(job.id, flush=True)
        sys.stdin.readline()
        os._exit(1)  # dies without closing
    """)
    env = {**os.environ, "SALUS_ADDRESS": server.address}
    with subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            job_id = proc.stdout.readline().strip()
            assert service.jobs[job_id]["done"] == 1 and job_id not in service.closed
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert service.wait_closed(job_id)
        finally:
            proc.kill()


def test_unknown_jobs_and_other_errors_surface_as_salus_errors(server: SocketServer) -> None:
    with salus.connect("probe", 3, address=server.address) as job:
        with pytest.raises(UnknownJob, match="no job"):
            job._call("info", job="12345")
        with pytest.raises(RuntimeError, match="train_step"):
            job.state_dict()
        model = make_mlp(0)
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              torch.nn.functional.mse_loss)
        with pytest.raises(JobFailed, match="mat1 and mat2") as info:
            step(torch.randn(4, 3), torch.randn(4, 2))  # wrong width: the job's code raises
        assert info.value.code == "job_failed"
        assert step(torch.randn(4, 8), torch.randn(4, 2)) > 0  # the connection is still fine
        with pytest.raises(TypeError, match="two tensors"):
            step([1.0], torch.randn(4, 2))


def test_oversized_payloads_get_a_clear_error(server: SocketServer) -> None:
    big = torch.zeros(40_000)  # 160 KB: over this server's 64 KiB inline limit
    with salus.connect("big", 3, address=server.address) as job:
        model = make_mlp(0)
        infer = job.inference(model)
        job._channel.shm_threshold = float("inf")  # force everything inline
        with pytest.raises(FrameTooLarge, match="65536-byte frame limit"):
            infer(big.view(-1, 8))
        job._channel.shm_threshold = 32 * 1024  # the same batch through shared memory is fine
        assert infer(big.view(-1, 8)).shape == (5000, 2)
    sock = raw_client(server)
    channel = Channel(sock, shm_threshold=float("inf"))
    channel.send({"op": "ping", "pad": b"x" * 100_000})
    reply = channel.recv()
    assert reply["code"] == "too_large" and "exceeds" in reply["message"]
    channel.send({"op": "ping"})
    assert channel.recv()["ok"] is True  # the oversized frame was skipped, the stream is in step
    channel.close()


def test_missing_daemon_gives_an_actionable_message(short_dir: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(short_dir, "nobody.sock")
    with pytest.raises(salus.DaemonUnavailable, match=f"no salusd listening at {path}: start "
                                                      "it with `salusd serve`"):
        salus.connect("x", 1, address=f"unix://{path}")
    monkeypatch.setenv("SALUS_ADDRESS", f"unix://{path}")
    with pytest.raises(salus.DaemonUnavailable, match="or set SALUS_ADDRESS"):
        salus.connect("x", 1)
    with pytest.raises(ValueError, match="unix:///"):
        salus.connect("x", 1, address="localhost:1234")


def test_stop_ends_connections_and_closes_their_jobs(service: LocalService,
                                                     short_dir: str) -> None:
    srv = SocketServer(os.path.join(short_dir, "s.sock"), service)
    srv.start()
    job = salus.connect("left-open", 5, address=srv.address)
    model = make_mlp(0)
    job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.nn.functional.mse_loss)
    assert job.id is not None and srv.connection_count() == 1
    srv.stop()
    assert job.id in service.closed and srv.connection_count() == 0
    with pytest.raises(salus.DaemonUnavailable, match="lost the connection"):
        job.info()
    job.close()


def test_a_non_salus_peer_gets_one_error_reply_and_a_hang_up(server: SocketServer) -> None:
    sock = raw_client(server)
    sock.sendall(b"\x00" * 64)
    channel = Channel(sock)
    reply = channel.recv()
    assert reply["ok"] is False and reply["code"] == "bad_frame" and "magic" in reply["message"]
    with pytest.raises(ConnectionClosed):
        channel.recv()
    channel.close()


# ---- compact step / infer frames --------------------------------------------------------------

def test_compact_and_json_frames_train_alike(server: SocketServer) -> None:
    data = batches(15)
    losses: dict[bool, list[float]] = {}
    states: dict[bool, dict[str, torch.Tensor]] = {}
    for use_compact in (True, False):
        model = make_mlp(2)
        with salus.connect("mlp", len(data), address=server.address) as job:
            assert job._compact  # the daemon offered compact frames in its ping reply
            job._compact = use_compact
            step = job.train_step(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                  torch.nn.functional.mse_loss)
            losses[use_compact] = [step(x.t().contiguous().t(), y) for x, y in data]
            states[use_compact] = job.state_dict()
    assert losses[True] == losses[False]
    for name, value in states[False].items():
        assert torch.equal(states[True][name], value)


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x.sum()


def test_compact_inference_with_a_non_tensor_output_falls_back_to_json(
    server: SocketServer,
) -> None:
    x = torch.randn(3, 4)
    with salus.connect("pair", 2, address=server.address) as job:
        assert job._compact
        plus, total = job.inference(Pair())(x)
    torch.testing.assert_close(plus, x + 1)
    torch.testing.assert_close(total, x.sum())


def test_a_daemon_without_compact_frames_gets_json(server: SocketServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ping = RequestHandler._ping

    def old_ping(self: RequestHandler, request: dict[str, Any]) -> dict[str, Any]:
        reply = ping(self, request)
        del reply["compact"]
        return reply

    monkeypatch.setattr(RequestHandler, "_ping", old_ping)
    sent: list[object] = []
    send = Channel.send

    def recording_send(self: Channel, message: Any) -> None:
        sent.append(message)
        send(self, message)

    monkeypatch.setattr(Channel, "send", recording_send)
    model = make_mlp(0)
    with salus.connect("old", 2, address=server.address) as job:
        assert not job._compact
        step = job.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              torch.nn.functional.mse_loss)
        assert step(torch.randn(4, 8), torch.randn(4, 2)) > 0
    assert not any(isinstance(m, compact.Message) for m in sent)


def compact_request(op: int, job: str, header_tail: bytes = b"", count: int = 0) -> bytes:
    header = struct.pack("<BBHId", op, count, len(job), 0, 0.0) + job.encode() + header_tail
    header += bytes(-len(header) % 64)
    return struct.pack("<4sBBHIQ", MAGIC, VERSION, FLAG_COMPACT, 0, len(header), 64) + header + \
        bytes(64)


def test_bad_compact_frames_get_error_replies_and_disturb_no_one(server: SocketServer) -> None:
    with steady_training(server, 6):
        channel = Channel(raw_client(server))
        x = torch.ones(2, 8)
        f32 = struct.pack("<BBBBIQ2q", 1, 2, 0, 0, 0, 0, 2, 8)
        cases = [
            (compact_request(0x55, "999"), "bad_frame", "unknown compact op"),
            (compact_request(compact.OP_STEP, "999", f32, count=1), "bad_frame", "2 belong"),
            (compact_request(compact.OP_INFER, "9" * 48, count=1), "bad_frame",
             "descriptor runs past"),
            (compact_request(compact.OP_INFER, "999", struct.pack("<BBBBIQ1q", 1, 1, 0, 0, 0, 0,
                                                                   1000), count=1),
             "bad_frame", "runs past the end"),
            (compact_request(compact.OP_LOSS, ""), "bad_request", "is a reply"),
        ]
        for _ in range(3):
            for frame, code, words in cases:
                channel.sock.sendall(frame)
                reply = channel.recv()
                assert (reply["code"], words in reply["message"]) == (code, True), reply
            channel.send(compact.Message(compact.OP_STEP, "999", (x, x)))
            reply = channel.recv()
            assert reply["code"] == "unknown_job" and "no job" in reply["message"]
            channel.send({"op": "ping"})
            assert channel.recv()["ok"] is True  # the connection is still in step
        channel.close()
