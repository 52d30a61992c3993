"""An executor process: runs one job's code, as the job's owner, for the daemon.

It is forked by the zygote (`zygote.py`) with torch already imported, so it starts in
milliseconds. Its first message from the daemon says who it becomes (`become`): as root it
drops to the owner's uid, gid and groups before it receives any job bytes, and then can do
exactly what the owner could do by running the script. Every later message from the daemon is a
JSON meta frame, followed by the client's own frame for the ops that carry one; every message
gets one meta reply, followed by the frame to forward to the client when `forward` is true.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
from typing import Any

import torch

from salus.daemon.executor.runtime import JobRuntime, call_error, error_text
from salus.daemon.measure import EstimationError
from salus.daemon.wire.channel import Channel, ConnectionClosed

log = logging.getLogger("salusd.executor")
_PR_SET_DUMPABLE = 4
_WITH_FRAME = frozenset({"attach", "define", "pull", "estimate", "run"})


def become(hello: dict[str, Any]) -> None:
    """Drop to the owner's identity (when running as root) and set up the job's environment:
    home, user name, working directory, intra-op threads, no core dumps."""
    uid, gid, groups = int(hello["uid"]), int(hello["gid"]), [int(g) for g in hello["groups"]]
    if os.geteuid() == 0 and uid != 0:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
        # Changing uid makes the process undumpable, which hands its /proc files to root and
        # would hide /proc/self/clear_refs (the peak meter) from the job; its owner may see it.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    if os.getuid() != uid:
        raise PermissionError(f"executor runs as uid {os.getuid()} and cannot become {uid}")
    os.environ.update({"HOME": str(hello.get("home") or "/"), "USER": str(hello["user"]),
                       "LOGNAME": str(hello["user"])})
    for place in (hello.get("cwd"), hello.get("home"), "/"):
        if isinstance(place, str):
            with contextlib.suppress(OSError):
                os.chdir(place)
                break
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    torch.set_num_threads(max(1, int(hello.get("threads", 1))))


def serve(sock: socket.socket) -> int:
    """The executor's loop until the daemon says `exit` or goes away; returns the exit code."""
    channel = Channel(sock)
    try:
        hello = channel.recv()
        become(hello)
    except ConnectionClosed:
        return 0
    runtime = JobRuntime()
    while True:
        try:
            meta = channel.recv()
            op = meta.get("op") if isinstance(meta, dict) else None
            request = channel.recv() if op in _WITH_FRAME else None
        except ConnectionClosed:
            return 0
        if op == "exit":
            return 0
        reply_meta, forward = handle(runtime, op, meta, request)
        try:
            _send(channel, reply_meta, forward)
        except TypeError as exc:  # a result that cannot be pickled fails its call only
            _send(channel, {**reply_meta, "ok": False},
                  call_error(TypeError(f"the call's result cannot be sent back: {exc}")))


def _send(channel: Channel, meta: dict[str, Any], forward: Any) -> None:
    meta = {**meta, "forward": forward is not None}
    channel.send_many([meta] if forward is None else [meta, forward])


def _error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "code": "bad_request", "message": error_text(exc)}


def handle(runtime: JobRuntime, op: object, meta: dict[str, Any],
           request: Any) -> tuple[dict[str, Any], Any]:
    """One message: (reply meta, reply to forward to the client or None)."""
    if op == "run":
        reply, seconds, peak = runtime.run(request)
        ok = not (isinstance(reply, dict) and reply.get("ok") is False)
        began, ended = runtime.last_span
        return {"ok": ok, "seconds": seconds, "peak": peak, "began": began,
                "ended": ended}, reply
    if op == "estimate":
        try:
            nbytes, method = runtime.estimate(request)
            return {"ok": True, "bytes": nbytes, "method": method}, None
        except (EstimationError, Exception) as exc:
            return {"ok": False, "reason": error_text(exc)}, None
    try:
        if op == "attach":
            result = runtime.attach(request)
            return {"ok": True, **result}, {"ok": True, "result": result}
        if op == "define":
            runtime.define(request)
            return {"ok": True}, {"ok": True, "result": None}
        if op == "pull":
            return {"ok": True}, runtime.pull(request)
        if op == "place":
            runtime.place(str(meta["device"]), int(meta["budget_bytes"]))
            return {"ok": True}, None
        if op == "swap_out":
            runtime.swap_out()
            return {"ok": True}, None
    except Exception as exc:
        return {"ok": False}, (_error(exc) if op in _WITH_FRAME else None)
    return {"ok": False, "message": f"unknown executor op {op!r}"}, None


def child_main(fd: int) -> None:
    """Entry point in a freshly forked executor: keep only the channel `fd` and stdio."""
    os.closerange(3, fd)
    os.closerange(fd + 1, 65536)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock = socket.socket(fileno=fd)
    code = 1
    try:
        code = serve(sock)
    except BaseException:
        log.exception("executor failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
