"""A real executor process, driven over its sockets as the daemon and a client drive it: a job
handed over while its client keeps calls in flight takes every call along, including the frames
the executor had already read off the client's socket but not yet parsed."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from salus.adapters.torch.pickling import pickled
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel, PickledPayload
from salus.daemon.wire.executor_ops import (
    Ack,
    Attach,
    Become,
    Define,
    DirectChannel,
    HandedOver,
    Handover,
    Host,
    Lease,
    addressed,
    decode_reply,
    encode,
)

EXECUTOR = ("import socket, sys; from salus.daemon.executor.main import serve; "
            "sys.exit(serve(socket.socket(fileno=int(sys.argv[1]))))")
JOB = 1


def slow_at_zero(s: Any, x: torch.Tensor) -> torch.Tensor:
    """The job's function: the call with x == 0 takes 0.3 s, so that everything sent during
    it arrives together."""
    if float(x) == 0.0:
        time.sleep(0.3)
    return x + 1


def _send(daemon: Channel, message: Any, frame: Any = None) -> None:
    meta = addressed(encode(message), JOB)
    daemon.send_many([meta] if frame is None else [meta, frame])


def _reply(daemon: Channel) -> Any:
    reply = daemon.recv()
    assert reply.pop("for_job") == JOB
    return decode_reply(reply)


def _call(x: float) -> compact.Message:
    return compact.Message(compact.OP_CALL, str(JOB), (torch.tensor(x),), 0)


@pytest.mark.slow
def test_a_handover_takes_the_frames_already_read_along(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", EXECUTOR, str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    daemon = Channel(ours)
    mine, executors = socket.socketpair()
    client = Channel(mine)
    try:
        me = pwd.getpwuid(os.getuid())
        daemon.send(encode(Become(me.pw_uid, me.pw_gid, tuple(os.getgroups()), me.pw_name,
                                  me.pw_dir, 1)))
        _send(daemon, Host(str(tmp_path), False))
        assert _reply(daemon) == Ack()
        _send(daemon, Attach(None), {"objects": pickled({"n": torch.zeros(1)})})
        assert _reply(daemon).forward and daemon.recv()["ok"] is True
        _send(daemon, Define(), {"fid": 0, "kind": "iteration",
                                 "fn": pickled(slow_at_zero, "function")})
        assert _reply(daemon) == Ack(forward=True) and daemon.recv()["ok"] is True
        _send(daemon, DirectChannel())
        daemon.send_socket({"op": "channel"}, executors.fileno())
        executors.close()
        assert _reply(daemon) == Ack(forward=True) and daemon.recv()["ok"] is True
        _send(daemon, Lease(True))
        assert _reply(daemon) == Ack()

        client.send(_call(0.0))  # runs under the lease for 0.3 s; meanwhile:
        time.sleep(0.05)
        client.send_many([_call(float(i)) for i in range(1, 6)])  # one sendmsg: read together
        daemon.send_many([addressed(encode(Lease(False)), JOB),  # read together, too
                          addressed(encode(Handover()), JOB)])
        first = client.recv()
        assert float(first.tensors[0]) == 1.0

        handed = None
        while handed is None:  # skip the lease's report, the ack and the next call's `ready`
            reply = _reply(daemon)
            if isinstance(reply, HandedOver):
                handed = reply
        assert handed.ok and handed.channel, handed
        payload = daemon.recv()["bundle"]
        assert isinstance(payload, PickledPayload)
        bundle = payload.load("the bundle", own=True)
        queued = [float(m.tensors[0]) for m in bundle["queued"]]
        assert queued == [1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        proc.kill()
        proc.wait()
        daemon.close()
        client.close()
