"""An executor process: runs one job's code, as the job's owner, for the daemon.

It is forked by the zygote (`zygote.py`) with torch already imported, so it starts in
milliseconds. Its first message from the daemon says who it becomes (`Become`): as root it
drops to the owner's uid, gid and groups before it receives any job bytes, and then can do
exactly what the owner could do by running the script. The messages, their replies and their
wire form are `salusd/wire/executor_ops.py`.
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
from dataclasses import replace
from typing import Any

import torch

from salus.daemon.executor import output
from salus.daemon.executor.measure import EstimationError
from salus.daemon.executor.runtime import JobRuntime, call_error, error_text, is_iteration
from salus.daemon.executor.visible import device_for
from salus.daemon.executor.zygote import die_with_parent, reap_orphans
from salus.daemon.services.slowdown import check_factor
from salus.daemon.wire.channel import YIELD_TAKEN_S, Channel, ConnectionClosed, FrameError
from salus.daemon.wire.executor_ops import (
    Ack,
    Attach,
    Become,
    CallDone,
    Checkpoint,
    Define,
    DirectChannel,
    Estimate,
    Estimated,
    EstimateFailed,
    Exit,
    Failed,
    Lease,
    Load,
    Place,
    Pull,
    Ran,
    Ready,
    Refuse,
    Reply,
    Request,
    Restore,
    Run,
    Step,
    SwapOut,
    client_frame_follows,
    decode_request,
    encode,
)

log = logging.getLogger("salusd.executor")
_PR_SET_DUMPABLE = 4
MAX_QUEUED_CALLS = 64
SPIN_US = 200.0  # see spin_window_s
REPORT_EVERY_S = 0.02  # leased calls are reported to the daemon in batches this often
_BUSY = object()  # a call refused for the bound, answered in its turn


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


def become(hello: Become) -> None:
    """Drop to the owner's identity (when running as root) and set up the job's environment:
    home, user name, working directory, intra-op threads, no core dumps."""
    uid, gid, groups = hello.uid, hello.gid, list(hello.groups)
    if os.geteuid() == 0 and uid != 0:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
        # Changing uid makes the process undumpable, which hands its /proc files to root and
        # would hide /proc/self/clear_refs (the peak meter) from the job; its owner may see it.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    if os.getuid() != uid:
        raise PermissionError(f"executor runs as uid {os.getuid()} and cannot become {uid}")
    os.environ.update({"HOME": hello.home or "/", "USER": hello.user, "LOGNAME": hello.user})
    for place in (hello.cwd, hello.home, "/"):
        if isinstance(place, str):
            with contextlib.suppress(OSError):
                os.chdir(place)
                break
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    torch.set_num_threads(max(1, hello.threads))


class Executor:
    """The loop of one executor: messages from the daemon, and calls from the job's client on
    its direct channel (once the client opened one).

    A direct call runs at once while the daemon has granted this job its lane (`lease`) and the
    daemon hears of it afterwards (`ran`); without a lease the executor asks (`ready`) and runs
    the call when the daemon answers `run`. Either way a lane runs one call at a time and the
    scheduler decides at every boundary where it must: the daemon grants a lease only to a job
    alone in its lane, and takes it back (`lease` false) before anything else may run there.
    """

    def __init__(self, sock: socket.socket, zygote: int | None = None) -> None:
        self.zygote = zygote  # the parent to die with (None: not forked by the zygote)
        self.daemon = Channel(sock)
        self.data: Channel | None = None
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "daemon")
        self.runtime = JobRuntime()
        self.lease = False
        self.asked = False
        self.queue: deque[Any] = deque()
        self.estimated = False  # the first call's peak goes with its `ready`, for admission
        self.ran: _RanSoFar | None = None  # leased calls not yet reported to the daemon
        self.spin_s = spin_window_s()  # poll this long after a message before blocking
        self.active_at = 0.0
        self.output: output.OutputSink | None = None  # the job's stdout and stderr

    def serve(self) -> int:
        try:
            hello = decode_request(self.daemon.recv())
        except ConnectionClosed:
            return 0
        if not isinstance(hello, Become):
            raise ValueError(f"the executor's first message must be 'become', not {hello.op!r}")
        become(hello)
        if self.zygote is not None:  # a change of uid cleared the parent-death signal
            die_with_parent(signal.SIGKILL, self.zygote)
        self.output = output.install(hello.log)
        # Where the daemon measures first calls, the first `ready` carries no estimate.
        self.estimated = not hello.estimate
        while True:
            sources = [name for name, ch in (("daemon", self.daemon), ("data", self.data))
                       if ch is not None and ch.buffered()]
            if not sources:
                sources = self._spin()
            if not sources:
                timeout = (None if self.ran is None else
                           max(0.0, self.ran.since + REPORT_EVERY_S - time.monotonic()))
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
        call (measured); and once a yield ran another process, the executor stops polling and
        sleeps. The sources that became readable."""
        now = time.perf_counter()
        until = self.active_at + self.spin_s
        while now < until:
            ready = self.selector.select(0)
            if ready:
                return [key.data for key, _ in ready]
            os.sched_yield()
            then, now = now, time.perf_counter()
            if now - then > YIELD_TAKEN_S:  # the yield ran another process: the CPU is wanted
                return []
        return []

    # ---- the daemon's messages ----------------------------------------------------------------
    def _from_daemon(self) -> bool:
        """Handle one message from the daemon; True when the executor must exit."""
        try:
            meta = self.daemon.recv()
            request = self.daemon.recv() if client_frame_follows(meta) else None
        except ConnectionClosed:
            self._refuse_queued("unavailable", "salusd went away")
            return True
        try:
            message = decode_request(meta)
        except ValueError as exc:
            with_frame = client_frame_follows(meta)
            self._reply(Failed(str(exc)[:2000], forward=with_frame),
                        _error(exc) if with_frame else None)
            return False
        match message:
            case Exit(code=code, message=text):
                self._refuse_queued(code, text)
                return True
            case Lease(granted=granted):
                self.lease = granted
                self._reply(Ack(), None)
            case Refuse(code=code, message=text):
                self._refuse_queued(code, text)
                self._reply(Ack(), None)
            case DirectChannel():
                self._open_channel(request)
            case Run() if request is None:
                self.asked = False
                self._refuse_busy_at_head()
                if self.queue:
                    done, reply = run_call(self.runtime, self.queue.popleft(), forward=False)
                    self._answer_client(reply)
                    self._reply(done, None)
                else:
                    # The call already ran under a lease granted meanwhile: nothing ran now.
                    self._reply(CallDone(False, 0.0, None, False, None, None, empty=True), None)
            case _:
                self._reply(*handle(self.runtime, message, request))
        return False

    def _open_channel(self, request: Any) -> None:
        fd = request.get("socket_fd") if isinstance(request, dict) else None
        if not isinstance(fd, int):
            self._reply(Failed(None, forward=True), _error(ValueError("'channel' needs a socket")))
            return
        if self.data is not None:
            os.close(fd)
            self._reply(Failed(None, forward=True),
                        _error(ValueError("the job already has a channel")))
            return
        sock = socket.socket(fileno=fd)
        self.data = Channel(sock)
        self.selector.register(sock, selectors.EVENT_READ, "data")
        if self.output is not None:
            self.output.attach(self.data)
        self._reply(Ack(forward=True), {"ok": True, "result": None})

    def _reply(self, reply: Reply, forward: Any) -> None:
        try:
            _send(self.daemon, reply, forward)
        except TypeError as exc:  # a result that cannot be pickled fails its call only
            failed = (replace(reply, ok=False) if isinstance(reply, CallDone)
                      else Failed(None, forward=True))
            _send(self.daemon, failed, _unsendable(exc))

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
            if self.output is not None:
                self.output.detach()
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
            done, reply = run_call(self.runtime, self.queue.popleft(), forward=False)
            self._answer_client(reply)
            self._note_ran(done)
            if done.oom:  # the daemon acts on it (moves or queues the job) without waiting
                self._report_ran()
            self._refuse_busy_at_head()
        if self.queue and not self.lease and not self.asked:
            self.asked = True
            estimate = None
            if not self.estimated:
                self.estimated = True
                estimate = estimate_call(self.runtime, self.queue[0])
            ready = Ready(is_iteration(self.queue[0], self.runtime.kinds), estimate)
            _send(self.daemon, ready, None)

    def _note_ran(self, done: CallDone) -> None:
        """Add one leased call to the next report (sent at most every REPORT_EVERY_S)."""
        if self.ran is None:
            self.ran = _RanSoFar(time.monotonic(), done.began)
        self.ran.add(done)

    def _report_ran(self) -> None:
        if self.ran is not None:
            ran, self.ran = self.ran, None
            _send(self.daemon, ran.report(), None)

    def _answer_client(self, reply: Any) -> None:
        if self.data is None:
            return
        try:
            with self._sending():
                try:
                    self.data.send(reply)
                except TypeError as exc:
                    self.data.send(_unsendable(exc))
        except OSError:
            self._close_channel()

    def _sending(self) -> contextlib.AbstractContextManager[object]:
        """Hold the job output's lock while a reply goes out on the channel, after what the
        job printed so far (a line printed on another thread never splits a reply)."""
        if self.output is None:
            return contextlib.nullcontext()
        sys.stdout.flush()
        sys.stderr.flush()
        return self.output.lock

    def _refuse_queued(self, code: str, message: str) -> None:
        error = {"ok": False, "code": code, "message": message}
        while self.queue:
            self.queue.popleft()
            self._answer_client(error)
        self.asked = False


def serve(sock: socket.socket, zygote: int | None = None) -> int:
    """The executor's loop until the daemon says `exit` or goes away; returns the exit code.
    `zygote`: the pid of the zygote that forked it, to die with."""
    return Executor(sock, zygote).serve()


class _RanSoFar:
    """Leased calls since the last `Ran` report: calls, iterations, failures, the iterations'
    seconds, the largest peak (bytes), the first call's start and the last one's end, and
    whether one ran out of device memory."""

    def __init__(self, since: float, began: float | None) -> None:
        self.since = since  # when the first of them was noted (time.monotonic)
        self.calls = self.iterations = self.failed = 0
        self.seconds = 0.0
        self.peak: int | None = None
        self.began = self.ended = began if began is not None else 0.0
        self.oom = False

    def add(self, done: CallDone) -> None:
        self.calls += 1
        self.iterations += done.counted
        self.failed += not done.ok
        self.seconds += done.seconds if done.counted else 0.0
        if done.peak is not None:
            self.peak = max(self.peak or 0, done.peak)
        if done.ended is not None:
            self.ended = done.ended
        self.oom = self.oom or done.oom

    def report(self) -> Ran:
        return Ran(self.calls, self.iterations, self.failed, self.seconds, self.peak,
                   self.began, self.ended, self.oom)


def _send(channel: Channel, reply: Reply, forward: Any) -> None:
    meta = encode(reply)
    channel.send_many([meta] if forward is None else [meta, forward])


def _unsendable(exc: TypeError) -> dict[str, Any]:
    """The error reply for a result the wire cannot carry (it fails its call only)."""
    return call_error(TypeError(f"the call's result cannot be sent back: {exc}"))


def _error(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "code": "bad_request", "message": error_text(exc)}


def run_call(runtime: JobRuntime, request: Any, forward: bool) -> tuple[CallDone, Any]:
    """Run the client's call `request`: (what the daemon is told, the client's reply).
    `forward`: the client's reply goes through the daemon."""
    counted = is_iteration(request, runtime.kinds)
    if counted:
        runtime.iterations += 1
    reply, seconds, peak = runtime.run(request)
    ok = not (isinstance(reply, dict) and reply.get("ok") is False)
    began, ended = runtime.last_span
    cache, comm = runtime.service_counters()
    message = None if ok else str(reply.get("message", ""))[:2000]
    return CallDone(ok, seconds, peak, counted, began, ended, message, cache, comm,
                    forward=forward, oom=runtime.last_oom is not None), reply


def estimate_call(runtime: JobRuntime, request: Any) -> Estimated | EstimateFailed:
    """The peak ephemeral bytes of `request` (None: a batch job's next batch) on fake
    tensors, or why they cannot be found."""
    try:
        nbytes, method = runtime.estimate(request)
        return Estimated(nbytes, method)
    except (EstimationError, Exception) as exc:
        return EstimateFailed(error_text(exc))


def handle(runtime: JobRuntime, message: Request, request: Any) -> tuple[Reply, Any]:
    """One message with the client's frame `request` (None: none came): (the reply, the
    client's answer to forward or None)."""
    if isinstance(message, Step):
        return runtime.step(), None
    if isinstance(message, Run):
        return run_call(runtime, request, forward=True)
    if isinstance(message, Estimate):
        return estimate_call(runtime, request), None
    try:
        match message:
            case Attach(gang=gang):
                attached = runtime.attach(request, gang)
                return replace(attached, forward=True), {"ok": True, "result": {
                    "persistent_bytes": attached.persistent_bytes,
                    "threads": attached.threads}}
            case Define():
                runtime.define(request)
                return Ack(forward=True), {"ok": True, "result": None}
            case Pull():
                return Ack(forward=True), runtime.pull(request)
            case Load():
                return runtime.load(message), None
            case Restore(dir=where, gang=gang, at=at):
                return runtime.restore(where, gang, at), None
            case Checkpoint(dir=where, job=job):
                return runtime.checkpoint(where, job), None
            case Place(device=device, budget_bytes=budget, slowdown=slowdown, uuid=uuid):
                seen = device_for(device, uuid, cuda_started=torch.cuda.is_initialized(),
                                  environ=os.environ)
                runtime.place(seen, budget, check_factor(slowdown))
                return Ack(), None
            case SwapOut():
                runtime.swap_out()
                return Ack(), None
    except Exception as exc:
        with_frame = isinstance(message, Attach | Define | Pull)
        return (Failed(error_text(exc)[:2000], forward=with_frame),
                _error(exc) if with_frame else None)
    return Failed(f"unknown executor op {message.op!r}"), None


def child_main(fd: int, zygote: int) -> None:
    """Entry point in an executor just forked by the zygote (pid `zygote`): keep only the
    channel `fd` and stdio; lead a process group of its own, die with the zygote, and keep
    the job's orphaned descendants as its children (the zygote kills them when it ends)."""
    os.closerange(3, fd)
    os.closerange(fd + 1, 65536)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL, zygote)
    reap_orphans()
    sock = socket.socket(fileno=fd)
    code = 1
    try:
        code = serve(sock, zygote)
    except BaseException:
        log.exception("executor failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
