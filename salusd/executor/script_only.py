"""The loop of an executor that runs script jobs only: one forked by a zygote of an interpreter
whose environment has no torch (`zygote.py`).

It takes the messages `main.Executor` takes for a script job: `Become`, then `Host` for its
job, then `Script`, on which the process runs the script to its end (`script.py`), or `Exit`.
It speaks JSON frames only (`wire/json_channel.py`) and imports nothing outside the standard
library before the script does. Any other job (a contract or batch job keeps torch state in
the executor) is refused with what its interpreter lacks.

`salusd run --here` runs this loop itself, in the caller's process, on a link the daemon adopts
(`in_pod.py`): there is no `Become`, and signals come as `Signal` messages.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from salus.daemon.executor import script
from salus.daemon.executor.boundaries import Boundaries
from salus.daemon.executor.in_pod import InPodChannel
from salus.daemon.executor.process import become
from salus.daemon.executor.zygote import die_with_parent
from salus.daemon.wire.executor_ops import (
    Ack,
    Become,
    Exit,
    Failed,
    Host,
    Reply,
    Script,
    Signal,
    address_of,
    addressed,
    client_frame_follows,
    decode_request,
    encode,
)
from salus.daemon.wire.frames import ConnectionClosed, passed_fd
from salus.daemon.wire.json_channel import JsonChannel


def serve(sock: socket.socket, zygote: int | None = None, *, in_pod: bool = False) -> int:
    """Serve the daemon on `sock` until it says `exit`, goes away, or a script ran; the exit
    code. `zygote`: the pid of the zygote that forked it, to die with. `in_pod`: salusd did
    not fork this process (`salusd run --here` did, as the caller): no `Become` comes, and
    the daemon signals and kills it through its link (`in_pod.py`)."""
    daemon = InPodChannel(sock) if in_pod else JsonChannel(sock)
    if not in_pod:
        try:
            hello = decode_request(daemon.recv())
        except ConnectionClosed:
            return 0
        if not isinstance(hello, Become):
            raise ValueError(f"the executor's first message must be 'become', not "
                             f"{hello.op!r}")
        become(hello)
        if zygote is not None:  # a change of uid cleared the parent-death signal
            die_with_parent(signal.SIGKILL, zygote)
    hosted: dict[int, Host] = {}
    while True:
        try:
            meta = daemon.recv()
            request = daemon.recv() if client_frame_follows(meta) else None
        except ConnectionClosed:
            return 0
        try:
            job = address_of(meta) if isinstance(meta, dict) else None
            message = decode_request(meta)
        except ValueError as exc:
            _refuse(daemon, None if not isinstance(meta, dict) else _job_or_none(meta),
                    str(exc), request)
            continue
        if isinstance(message, Signal):  # before its script runs: the default action
            os.kill(os.getpid(), message.signum)
        elif job is None:
            if isinstance(message, Exit):  # the whole process
                return 0
            _refuse(daemon, None, f"{message.op!r} must name its job", request)
        elif isinstance(message, Host):
            hosted[job] = message
            _reply(daemon, job, Ack())
        elif job not in hosted:
            _refuse(daemon, job, f"this executor hosts no job {job}", request)
        elif isinstance(message, Script):
            host = hosted[job]
            if script.run(daemon, message, request, job, host.estimate, host.log, host.cwd):
                return 0
            Boundaries(daemon, job, False).drain()  # it failed: until the daemon lets it go
            return 0
        elif isinstance(message, Exit):
            hosted.pop(job)
            _reply(daemon, job, Ack())
        else:
            _refuse(daemon, job, f"{sys.executable} cannot import torch, so its executors run "
                    f"script jobs only, not {message.op!r}", request)


def _job_or_none(meta: dict[str, Any]) -> int | None:
    try:
        return address_of(meta)
    except ValueError:
        return None


def _reply(daemon: JsonChannel, job: int | None, reply: Reply) -> None:
    daemon.send(encode(reply) if job is None else addressed(encode(reply), job))


def _refuse(daemon: JsonChannel, job: int | None, why: str, request: Any) -> None:
    """Fail the message; a client frame that came with it gets the error as its answer."""
    fd = passed_fd(request)
    if fd is not None:
        os.close(fd)
    _reply(daemon, job, Failed(why[:2000], forward=request is not None))
    if request is not None:
        daemon.send({"ok": False, "code": "bad_request", "message": why[:2000]})
