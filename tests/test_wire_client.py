"""The client side every client of salusd's socket shares (`salus.daemon.wire.client`): replies
matched with requests in order, a lost connection failing every request still waiting, a
refusal read even when the request could not be sent, a bad frame costing only its own
request, messages that answer no request set aside, and the hello's checks. Each test speaks
to the `Line` over a real socket pair, the far end written by hand as salusd would."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.client import Line, hello
from salus.daemon.wire.errors import Busy, DaemonUnavailable, UnknownJob
from salus.daemon.wire.frames import VERSION, FrameError, json_frame
from salus.daemon.wire.json_channel import JsonChannel


def _pair() -> tuple[Line, JsonChannel]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Line(JsonChannel(ours), "/run/test.sock"), JsonChannel(theirs)


def _ok(result: Any) -> dict[str, Any]:
    return {"ok": True, "result": result}


def test_replies_resolve_their_own_requests_in_order_whichever_is_waited_for_first() -> None:
    line, daemon = _pair()
    first = line.request(ops.Info("1"))
    second = line.request(ops.Info("2"))
    third = line.request(ops.Info("3"))
    asked = [daemon.recv()["job"] for _ in range(3)]
    assert asked == ["1", "2", "3"]
    daemon.send(_ok({"job": 1}))
    daemon.send({"ok": False, "code": "unknown_job", "message": "no job 2"})
    daemon.send(_ok({"job": 3}))
    assert third.result() == {"job": 3}  # reading up to it resolves the two before it
    assert first.done() and second.done()
    assert first.result() == {"job": 1}
    with pytest.raises(UnknownJob, match="no job 2"):
        second.result()


def test_a_lost_connection_fails_every_waiting_request_and_every_later_one() -> None:
    line, daemon = _pair()
    waiting = [line.request(ops.Status()) for _ in range(3)]
    daemon.send(_ok("first"))
    daemon.close()
    assert waiting[0].result() == "first"
    for pending in waiting[1:]:
        with pytest.raises(DaemonUnavailable, match="lost the connection to salusd at "
                           "/run/test.sock"):
            pending.result()
    with pytest.raises(DaemonUnavailable):
        line.request(ops.Status())


def test_a_refusal_is_read_even_when_the_request_could_not_go_out() -> None:
    """salusd over its connection limit answers at once and closes: the ping may then fail to
    send (EPIPE), and the refusal it wrote is still what the caller sees."""
    line, daemon = _pair()
    daemon.send({"ok": False, "code": "busy", "message": "salusd serves 1024 connections"})
    daemon.sock.shutdown(socket.SHUT_RDWR)
    daemon.close()
    with pytest.raises(Busy, match="1024 connections"):
        hello(line)


def test_a_frame_that_is_not_json_fails_only_the_request_it_answers() -> None:
    line, daemon = _pair()
    bad, good = line.request(ops.Status()), line.request(ops.Status())
    frame = json_frame({})
    frame.body = b"\xff not json"
    daemon.sock.sendall(b"".join(frame.buffers()))
    daemon.send(_ok(2))
    assert good.result() == 2
    with pytest.raises(FrameError):
        bad.result()


def test_messages_that_answer_no_request_are_set_aside() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    printed: list[str] = []

    def aside(message: Any) -> bool:
        if isinstance(message, dict) and message.get("op") == "output":
            printed.append(message["text"])
            return True
        return False

    line, executor = Line(JsonChannel(ours), "x", aside=aside), JsonChannel(theirs)
    call = line.request({"op": "call"})
    executor.send({"op": "output", "text": "epoch 1\n"})
    executor.send(_ok(0.5))
    assert call.result() == 0.5
    assert printed == ["epoch 1\n"]


def test_hello_checks_the_protocol_version_and_a_refusal() -> None:
    line, daemon = _pair()
    daemon.send(_ok({"version": VERSION + 1, "owner": "ada"}))
    with pytest.raises(DaemonUnavailable, match="another protocol version"):
        hello(line)
    line, daemon = _pair()
    daemon.send(_ok({"version": VERSION, "refused": "salusd is stopping"}))
    with pytest.raises(DaemonUnavailable, match="salusd is stopping"):
        hello(line)
    line, daemon = _pair()
    daemon.send(_ok({"version": VERSION, "owner": "ada", "max_frame_bytes": 1 << 20}))
    assert hello(line, 4096)["owner"] == "ada"
    assert daemon.recv() == {"op": "ping", "max_frame_bytes": 4096}


def test_a_descriptor_goes_with_its_request() -> None:
    line, daemon = _pair()
    a, b = socket.socketpair()
    line.request(ops.Socket(), fd=b.fileno())
    b.close()
    got = daemon.recv()
    passed = socket.socket(fileno=got.pop("socket_fd"))
    assert got == {"op": "socket"}
    a.sendall(b"hi")
    assert passed.recv(2) == b"hi"
    passed.close()
    a.close()
