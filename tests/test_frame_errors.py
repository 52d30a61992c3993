"""Frames salusd cannot read get a reason before the connection closes, against the real
daemon: an old protocol version (answered in that version), a wrong magic, an oversize frame, a
segment flag without a descriptor; a too deeply nested JSON header is a bad_request naming the
limit; forged references in `attach` are a bad_request naming the field, and the job's executor
lives on; a result that cannot be pickled says so, once and the right way round. Also: today's
Channel reports what a peer of another version said."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemon_proc import salusd

import salus.adapters.torch as salus
from salus.daemon.wire.channel import Channel, Pickled
from salus.daemon.wire.codec import PickledPayload
from salus.daemon.wire.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_SEGMENT,
    MAX_JSON_DEPTH,
    FrameError,
    json_frame,
)

pytestmark = pytest.mark.slow
FIXED = struct.Struct("<4sBBHIQ")  # the documented layout, written out independently


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with salusd(tmp_path_factory.mktemp("frames"), devices=1) as (_, addr):
        yield addr


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(address.removeprefix("unix://"))
    return sock


def _frame(header: bytes, body: bytes = b"", *, magic: bytes = b"SLUS", version: int = 2,
           flags: int = 0, body_len: int | None = None) -> bytes:
    header += b" " * (-len(header) % 64)
    return FIXED.pack(magic, version, flags, 0, len(header),
                      len(body) if body_len is None else body_len) + header + body


def _reply(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """(frame version, JSON reply) of the next frame."""
    fixed = _exactly(sock, FIXED.size)
    magic, version, _, _, header_len, body_len = FIXED.unpack(fixed)
    assert magic == b"SLUS"
    header = _exactly(sock, header_len)
    _exactly(sock, body_len)
    return version, json.loads(header)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        assert got, f"the connection closed after {len(data)} of {n} bytes"
        data += got
    return data


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(("frame", "version", "code", "says"), [
    (_frame(b'{"op":"ping"}', version=1), 1, "bad_frame",
     "frame version 1, this side speaks 2: install matching salusd and adapter versions"),
    (_frame(b'{"op":"ping"}', magic=b"HTTP"), 2, "bad_frame", "not a salusd frame"),
    (_frame(b'{"op":"ping"}', body_len=DEFAULT_MAX_FRAME_BYTES)[:FIXED.size], 2, "too_large",
     f"exceeds the {DEFAULT_MAX_FRAME_BYTES}-byte limit"),
    (_frame(b'{"op":"ping"}', flags=FLAG_SEGMENT), 2, "bad_frame",
     "announces a shared-memory segment but no descriptor came with it"),
], ids=["old-version", "bad-magic", "oversize", "segment-without-descriptor"])
def test_a_frame_salusd_cannot_read_is_answered_before_the_close(
        address: str, frame: bytes, version: int, code: str, says: str) -> None:
    with _connect(address) as sock:
        sock.sendall(frame)
        got_version, reply = _reply(sock)
        assert got_version == version  # the sender's version, which it can parse
        assert reply["ok"] is False and reply["code"] == code, reply
        assert says in reply["message"], reply
        assert _closed(sock)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_a_too_deeply_nested_header_is_a_bad_request_naming_the_limit(address: str,
                                                                     depth: int) -> None:
    with _connect(address) as sock:
        sock.sendall(_frame(b'{"op":"ping","x":' + b"[" * depth + b"]" * depth + b"}"))
        _, reply = _reply(sock)
        assert reply["ok"] is False and reply["code"] == "bad_frame", reply
        assert f"more than {MAX_JSON_DEPTH} levels deep" in reply["message"]
        sock.sendall(b"".join(json_frame({"op": "ping"}).buffers()))  # the connection goes on
        assert _reply(sock)[1]["ok"] is True


def test_forged_references_in_attach_are_refused_and_the_executor_lives_on(
        address: str) -> None:
    with _connect(address) as sock:
        channel = Channel(sock)
        channel.send({"op": "open", "name": "forged", "iterations": 1})
        opened = channel.recv()
        assert opened["ok"], opened
        job = opened["result"]["job"]
        forged = [
            ({"data": {"$": "b", "len": 100, "seg": 0, "off": 0}, "storages": []},
             "objects.data", "runs past the end"),
            ({"data": {"$": "b", "len": 4, "seg": 0, "off": 0},
              "storages": [{"$": "t", "dtype": "nope", "shape": [4], "seg": 0, "off": 0}]},
             "objects.storages[0]", "unknown tensor dtype 'nope'"),
        ]
        for objects, field, says in forged:
            header = json.dumps({"op": "attach", "job": job,
                                 "objects": {"$": "p", **objects}}).encode()
            sock.sendall(_frame(header, bytes(64)[:4]))
            reply = channel.recv()
            assert reply["ok"] is False and reply["code"] == "bad_request", reply
            assert f"field '{field}'" in reply["message"] and says in reply["message"], reply
        channel.send({"op": "attach", "job": job, "objects": Pickled({"w": torch.ones(2)})})
        attached = channel.recv()
        assert attached["ok"], attached
        channel.send({"op": "call", "job": job, "fn": Pickled(lambda s: float(s.w.sum()) + 40),
                      "args": Pickled(((), {}))})
        reply = channel.recv()
        assert reply["ok"], reply
        result = reply["result"]
        assert isinstance(result, PickledPayload) and result.load() == 42.0


def test_today_s_channel_reports_what_a_peer_of_another_version_said() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        error = json.dumps({"ok": False, "code": "bad_frame",
                            "message": "frame version 2, this side speaks 3: upgrade"}).encode()
        theirs.sendall(_frame(error, version=3))
        with pytest.raises(FrameError, match="salusd said: frame version 2, this side speaks 3"
                           ) as raised:
            Channel(ours).recv()
        assert not raised.value.recoverable


def test_an_unpicklable_result_says_which_way_it_could_not_go(address: str) -> None:
    with salus.connect(name="lock", iterations=1, address=address) as job:
        remote = job.attach(model=torch.nn.Linear(2, 2))
        with pytest.raises(TypeError) as raised:  # the job's own exception type
            remote.call(lambda s: threading.Lock())
    message = str(raised.value)
    assert "cannot pickle the call's result" in message and "the the" not in message, message
    assert "to salusd" not in message, message
