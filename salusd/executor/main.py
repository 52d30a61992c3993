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
import selectors
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

import torch

from salus.daemon.executor.measure import EstimationError
from salus.daemon.executor.runtime import JobRuntime, call_error, error_text
from salus.daemon.services.slowdown import check_factor
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel, ConnectionClosed, FrameError
from salus.daemon.wire.frames import FUNCTION_MASK

log = logging.getLogger("salusd.executor")
_PR_SET_DUMPABLE = 4
MAX_QUEUED_CALLS = 64
SPIN_US = 200.0  # see spin_window_s
REPORT_EVERY_S = 0.02  # leased calls are reported to the daemon in batches this often
_BUSY = object()  # a call refused for the bound, answered in its turn
_WITH_FRAME = frozenset({"attach", "define", "pull", "estimate", "run", "channel"})


def spin_window_s() -> float:
    """How long an executor polls for the next message before it blocks (seconds), from
    `$SALUS_SPIN_US` (microseconds, default `SPIN_US`; 0 turns polling off).

    A process blocked in `epoll_wait` lets its CPU idle, and the message that wakes it pays the
    kernel's (in a virtual machine, also the hypervisor's) wake-up path: 25-40 µs per hop on the
    2-vCPU build VM, against under 4 µs for a peer that polls. Polling is bounded to the window
    after each message, where the next call of a training loop comes, so an idle executor
    sleeps. The client does not poll while its call runs: where its CPU is a hyperthread
    sibling of the executor's, polling slowed the call itself by half (measured)."""
    try:
        us = float(os.environ.get("SALUS_SPIN_US", SPIN_US))
    except ValueError:
        us = SPIN_US
    return max(0.0, min(us, 100_000.0)) / 1e6


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


class Executor:
    """The loop of one executor: messages from the daemon, and calls from the job's client on
    its direct channel (once the client opened one).

    A direct call runs at once while the daemon has granted this job its lane (`lease`) and the
    daemon hears of it afterwards (`ran`); without a lease the executor asks (`ready`) and runs
    the call when the daemon answers `run`. Either way a lane runs one call at a time and the
    scheduler decides at every boundary where it must: the daemon grants a lease only to a job
    alone in its lane, and takes it back (`lease` false) before anything else may run there.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.daemon = Channel(sock)
        self.data: Channel | None = None
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "daemon")
        self.runtime = JobRuntime()
        self.lease = False
        self.asked = False
        self.queue: deque[Any] = deque()
        self.estimated = False  # the first call's peak goes with its `ready`, for admission
        self.ran: dict[str, Any] | None = None  # leased calls not yet reported to the daemon
        self.ran_since = 0.0
        self.spin_s = spin_window_s()  # poll this long after a message before blocking
        self.active_at = 0.0

    def serve(self) -> int:
        try:
            hello = self.daemon.recv()
            become(hello)
        except ConnectionClosed:
            return 0
        # Where the daemon measures first calls, the first `ready` carries no estimate.
        self.estimated = not hello.get("estimate", True)
        while True:
            sources = [name for name, ch in (("daemon", self.daemon), ("data", self.data))
                       if ch is not None and ch.buffered()]
            if not sources:
                sources = self._spin()
            if not sources:
                timeout = (None if self.ran is None else
                           max(0.0, self.ran_since + REPORT_EVERY_S - time.monotonic()))
                sources = [key.data for key, _ in self.selector.select(timeout)]
                if not sources:
                    self._report_ran()
            for source in sources:
                if source == "daemon":
                    self._report_ran()  # the daemon decides knowing what ran
                    if self._from_daemon():
                        return 0
                else:
                    self._from_client()
            self._run_queued()
            self.active_at = time.perf_counter()

    def _spin(self) -> list[str]:
        """Poll, without sleeping, for `spin_s` after the last message: a training loop sends
        its next call within microseconds of its result, and a call that finds the executor
        blocked pays the wake-up path (see `spin_window_s`). Each empty poll yields the CPU,
        so that where other processes wait for it (many jobs on few cores) the window costs
        them nothing: polling without yielding made 8 small jobs on 2 cores 1.2x slower per
        call (measured). The sources that became readable."""
        until = self.active_at + self.spin_s
        while time.perf_counter() < until:
            ready = self.selector.select(0)
            if ready:
                return [key.data for key, _ in ready]
            os.sched_yield()
        return []

    # ---- the daemon's messages ----------------------------------------------------------------
    def _from_daemon(self) -> bool:
        """Handle one message from the daemon; True when the executor must exit."""
        try:
            meta = self.daemon.recv()
            op = meta.get("op") if isinstance(meta, dict) else None
            request = (self.daemon.recv() if op in _WITH_FRAME and meta.get("frame", True)
                       else None)
        except ConnectionClosed:
            self._refuse_queued({"code": "unavailable", "message": "salusd went away"})
            return True
        if op == "exit":
            self._refuse_queued({"code": meta.get("code", "job_cancelled"),
                                 "message": meta.get("message", "the job ended")})
            return True
        if op == "lease":
            self.lease = bool(meta.get("granted"))
            self._reply({"ok": True}, None)
        elif op == "refuse":
            self._refuse_queued(meta)
            self._reply({"ok": True}, None)
        elif op == "channel":
            self._open_channel(request)
        elif op == "run" and request is None:
            self.asked = False
            self._refuse_busy_at_head()
            if self.queue:
                reply_meta, reply = self._run(self.queue.popleft())
                self._answer_client(reply)
                self._reply(reply_meta, None)
            else:
                # The call already ran under a lease granted meanwhile: nothing ran now.
                self._reply({"ok": False, "empty": True, "seconds": 0.0, "peak": None}, None)
        else:
            self._reply(*handle(self.runtime, op, meta, request))
        return False

    def _open_channel(self, request: Any) -> None:
        fd = request.get("socket_fd") if isinstance(request, dict) else None
        if not isinstance(fd, int):
            self._reply({"ok": False}, _error(ValueError("'channel' needs a socket")))
            return
        if self.data is not None:
            os.close(fd)
            self._reply({"ok": False}, _error(ValueError("the job already has a channel")))
            return
        sock = socket.socket(fileno=fd)
        self.data = Channel(sock)
        self.selector.register(sock, selectors.EVENT_READ, "data")
        self._reply({"ok": True}, {"ok": True, "result": None})

    def _reply(self, meta: dict[str, Any], forward: Any) -> None:
        try:
            _send(self.daemon, meta, forward)
        except TypeError as exc:  # a result that cannot be pickled fails its call only
            _send(self.daemon, {**meta, "ok": False}, _unsendable(exc))

    # ---- the client's direct calls ------------------------------------------------------------
    def _from_client(self) -> None:
        assert self.data is not None
        try:
            request = self.data.recv()
            self.queue.append(request if len(self.queue) < MAX_QUEUED_CALLS else _BUSY)
        except (ConnectionClosed, OSError):
            self._close_channel()
        except FrameError as exc:
            self._answer_client({"ok": False, "code": exc.code, "message": str(exc)})
            if not exc.recoverable:
                self._close_channel()

    def _close_channel(self) -> None:
        if self.data is not None:
            self.selector.unregister(self.data.sock)
            self.data.close()
            self.data = None
        self.queue.clear()

    def _refuse_busy_at_head(self) -> None:
        while self.queue and self.queue[0] is _BUSY:
            self.queue.popleft()
            self._answer_client({"ok": False, "code": "busy", "message": (
                f"the job already has {MAX_QUEUED_CALLS} calls queued; wait for results "
                "before submitting more")})

    def _run_queued(self) -> None:
        self._refuse_busy_at_head()
        while self.queue and self.lease:
            request = self.queue.popleft()
            reply_meta, reply = self._run(request)
            self._answer_client(reply)
            self._note_ran(reply_meta)
            self._refuse_busy_at_head()
        if self.queue and not self.lease and not self.asked:
            self.asked = True
            ready: dict[str, Any] = {"op": "ready", "unsolicited": True,
                                     "counted": self._counted(self.queue[0])}
            if not self.estimated:
                self.estimated = True
                estimate, _ = handle(self.runtime, "estimate", {}, self.queue[0])
                ready["estimate"] = estimate
            _send(self.daemon, ready, None)

    def _note_ran(self, meta: dict[str, Any]) -> None:
        """Add one leased call to the next report (sent at most every REPORT_EVERY_S)."""
        counted = bool(meta.get("counted"))
        if self.ran is None:
            self.ran = {"op": "ran", "unsolicited": True, "calls": 0, "iterations": 0,
                        "failed": 0, "seconds": 0.0, "peak": None, "began": meta.get("began")}
            self.ran_since = time.monotonic()
        ran = self.ran
        ran["calls"] += 1
        ran["iterations"] += counted
        ran["failed"] += 0 if meta.get("ok") else 1
        ran["seconds"] += float(meta.get("seconds", 0.0)) if counted else 0.0
        peak = meta.get("peak")
        if isinstance(peak, int):
            ran["peak"] = max(ran["peak"] or 0, peak)
        ran["ended"] = meta.get("ended")

    def _report_ran(self) -> None:
        if self.ran is not None:
            ran, self.ran = self.ran, None
            _send(self.daemon, ran, None)

    def _run(self, request: Any) -> tuple[dict[str, Any], Any]:
        counted = self._counted(request)
        reply_meta, reply = handle(self.runtime, "run", {"counted": counted}, request)
        reply_meta["counted"] = counted
        return reply_meta, reply

    def _counted(self, request: Any) -> bool:
        fid = (request.aux & FUNCTION_MASK if type(request) is compact.Message
               else request.get("fid") if isinstance(request, dict) else None)
        return self.runtime.kinds.get(fid) == "iteration" if type(fid) is int else False

    def _answer_client(self, reply: Any) -> None:
        if self.data is None:
            return
        try:
            self.data.send(reply)
        except TypeError as exc:
            self.data.send(_unsendable(exc))
        except OSError:
            self._close_channel()

    def _refuse_queued(self, meta: dict[str, Any]) -> None:
        error = {"ok": False, "code": str(meta.get("code", "job_cancelled")),
                 "message": str(meta.get("message", "the job ended"))}
        while self.queue:
            self.queue.popleft()
            self._answer_client(error)
        self.asked = False


def serve(sock: socket.socket) -> int:
    """The executor's loop until the daemon says `exit` or goes away; returns the exit code."""
    return Executor(sock).serve()


def _send(channel: Channel, meta: dict[str, Any], forward: Any) -> None:
    meta = {**meta, "forward": forward is not None}
    channel.send_many([meta] if forward is None else [meta, forward])


def _unsendable(exc: TypeError) -> dict[str, Any]:
    """The error reply for a result the wire cannot carry (it fails its call only)."""
    return call_error(TypeError(f"the call's result cannot be sent back: {exc}"))


def _error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "code": "bad_request", "message": error_text(exc)}


def handle(runtime: JobRuntime, op: object, meta: dict[str, Any],
           request: Any) -> tuple[dict[str, Any], Any]:
    """One message: (reply meta, reply to forward to the client or None)."""
    if op == "step":
        return runtime.step(), None
    if op == "run":
        if meta.get("counted"):
            runtime.iterations += 1
        reply, seconds, peak = runtime.run(request)
        ok = not (isinstance(reply, dict) and reply.get("ok") is False)
        began, ended = runtime.last_span
        out = {"ok": ok, "seconds": seconds, "peak": peak, "began": began, "ended": ended,
               **runtime.service_counters()}
        if not ok:
            out["message"] = str(reply.get("message", ""))[:2000]
        return out, reply
    if op == "estimate":
        try:
            nbytes, method = runtime.estimate(request)
            return {"ok": True, "bytes": nbytes, "method": method}, None
        except (EstimationError, Exception) as exc:
            return {"ok": False, "reason": error_text(exc)}, None
    try:
        if op == "attach":
            result = runtime.attach(request, meta.get("gang"))
            return {"ok": True, **result}, {"ok": True, "result": result}
        if op == "define":
            runtime.define(request)
            return {"ok": True}, {"ok": True, "result": None}
        if op == "pull":
            return {"ok": True}, runtime.pull(request)
        if op in ("load", "restore"):
            result = runtime.load(meta) if op == "load" else runtime.restore(meta)
            return {"ok": True, **result}, None
        if op == "checkpoint":
            return {"ok": True, **runtime.checkpoint(meta)}, None
        if op == "place":
            runtime.place(str(meta["device"]), int(meta["budget_bytes"]),
                          check_factor(meta.get("slowdown", 1.0)))
            return {"ok": True}, None
        if op == "swap_out":
            runtime.swap_out()
            return {"ok": True}, None
    except Exception as exc:
        return {"ok": False, "message": error_text(exc)[:2000]}, (
            _error(exc) if op in _WITH_FRAME else None)
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
