"""A real executor process driven over its socket as the daemon drives it (`serve` on one end
of a socket pair), for tests that need the executor's own loop without a daemon around it."""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from salus.adapters.torch.pickling import pickled
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import (
    Ack,
    Attach,
    Become,
    Define,
    DirectChannel,
    Host,
    Lease,
    addressed,
    decode_reply,
    encode,
)

EXECUTOR = ("import socket, sys; from salus.daemon.executor.main import serve; "
            "sys.exit(serve(socket.socket(fileno=int(sys.argv[1]))))")
JOB = 1


def daemon_send(daemon: Channel, message: Any, frame: Any = None) -> None:
    """Send `message` for job JOB, with the client's `frame` after it."""
    meta = addressed(encode(message), JOB)
    daemon.send_many([meta] if frame is None else [meta, frame])


def daemon_reply(daemon: Channel) -> Any:
    """The executor's next reply about job JOB."""
    reply = daemon.recv()
    assert reply.pop("for_job") == JOB
    return decode_reply(reply)


def start_job(daemon: Channel, tmp_path: Path, fn: Callable[..., Any]) -> None:
    """Make the executor this user's, host job JOB, attach a small state and define `fn` as
    its function 0 (an iteration)."""
    me = pwd.getpwuid(os.getuid())
    daemon.send(encode(Become(me.pw_uid, me.pw_gid, tuple(os.getgroups()), me.pw_name,
                              me.pw_dir, 1)))
    daemon_send(daemon, Host(str(tmp_path), False))
    assert daemon_reply(daemon) == Ack()
    daemon_send(daemon, Attach(None), {"objects": pickled({"n": torch.zeros(1)})})
    assert daemon_reply(daemon).forward and daemon.recv()["ok"] is True
    daemon_send(daemon, Define(), {"fid": 0, "kind": "iteration",
                                   "fn": pickled(fn, "function")})
    assert daemon_reply(daemon) == Ack(forward=True) and daemon.recv()["ok"] is True


@contextlib.contextmanager
def leased_job(tmp_path: Path, fn: Callable[..., Any], *,
               pool: bool = False) -> Iterator[tuple[Channel, Channel]]:
    """A real executor with job JOB started (`start_job`), its client's direct channel open
    (with `pool`, the client's end sends large tensors through a pool) and a lease granted:
    (the daemon's end, the client's end). The executor is killed on leaving."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", EXECUTOR, str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    daemon = Channel(ours)
    mine, executors = socket.socketpair()
    client = Channel(mine, pool=pool)
    try:
        start_job(daemon, tmp_path, fn)
        daemon_send(daemon, DirectChannel())
        daemon.send_socket({"op": "channel"}, executors.fileno())
        executors.close()
        assert daemon_reply(daemon) == Ack(forward=True) and daemon.recv()["ok"] is True
        daemon_send(daemon, Lease(True))
        assert daemon_reply(daemon) == Ack()
        yield daemon, client
    finally:
        proc.kill()
        proc.wait()
        daemon.close()
        client.close()
