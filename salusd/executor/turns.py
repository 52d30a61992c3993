"""One job's turn in its lane: the protocol every job kind follows with the daemon.

A job's work comes in iterations: a contract job's calls (from its client, or a batch job's
next batch from the daemon) and a script job's run between two boundaries. Each is scheduled
the same way (the shape of Ray's worker lease): the executor asks for a turn (`Ready`); the
daemon grants one iteration (`Run`, answered by `CallDone` once it ran) or the lane
(`Lease(True)`, under which iterations go on at once and are reported in batches, `Ran`), takes
the lane back (`Lease(False)`), refuses what waits (`Refuse`), ends the job (`Exit`), places it
(`Place`) or swaps it out (`SwapOut`).

`Turn` holds that state for one job, and `HANDLERS` is the one table from those messages to
what they do; what differs between job kinds is behind `JobKind`: a contract job runs a
granted call at once, a script job at its next boundary; a contract job moves its state when
it is placed, a script job has none the executor holds. The CUDA rules of a place (the GPU an
executor sees, MPS, the process's cap) are applied here, once, for every kind.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from salus.daemon.devices.mps import client_environment
from salus.daemon.executor.cap import ProcessCap, cuda_started
from salus.daemon.executor.visible import device_for
from salus.daemon.wire.executor_ops import (
    Ack,
    CallDone,
    Estimated,
    EstimateFailed,
    Exit,
    Lease,
    Place,
    Ran,
    Ready,
    Refuse,
    Reply,
    Request,
    Run,
    SwapOut,
)

REPORT_EVERY_S = 0.02  # iterations run under a lease are reported to the daemon this often


class RanSoFar:
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


class Turn:
    """One job's side of the turn protocol: whether it holds the lane (`lease`), whether a
    `Ready` is with the daemon (`asked`), whether a `Run` was granted and its `CallDone` is
    still owed (`granted`), and the leased iterations not yet reported (`ran`)."""

    def __init__(self) -> None:
        self.lease = False
        self.asked = False
        self.granted = False
        self.ran: RanSoFar | None = None

    def ask(self, counted: bool,
            estimate: Estimated | EstimateFailed | None = None) -> Ready | None:
        """The `Ready` to send for waiting work (`counted`: it is an iteration), or None when
        it may go on at once (a lease or a granted run) or one was already sent."""
        if self.lease or self.granted or self.asked:
            return None
        self.asked = True
        return Ready(counted, estimate)

    def may_go(self) -> bool:
        """Whether the job's next iteration may run now."""
        return self.lease or self.granted

    def done(self, done: CallDone, now: float | None = None) -> CallDone | Ran | None:
        """An iteration ended: the `CallDone` owed for a granted run, or, under a lease, the
        `Ran` batch once one is due (None: noted for a later batch)."""
        if self.granted:
            self.granted = False
            return done
        if self.ran is None:
            self.ran = RanSoFar(time.monotonic() if now is None else now, done.began)
        self.ran.add(done)
        if done.oom:  # the daemon acts on it (moves or queues the job) without waiting
            return self.report()
        if (time.monotonic() if now is None else now) - self.ran.since >= REPORT_EVERY_S:
            return self.report()
        return None

    def report(self) -> Ran | None:
        """The leased iterations not yet reported, as one `Ran` (None: none)."""
        ran, self.ran = self.ran, None
        return None if ran is None else ran.report()

    def report_due(self, now: float) -> float | None:
        """Seconds until the oldest unreported leased iteration must be reported."""
        if self.ran is None:
            return None
        return max(0.0, self.ran.since + REPORT_EVERY_S - now)


class JobKind(Protocol):
    """What one job kind does on the turn's messages (`HANDLERS`); each returns the reply to
    send, or None when the reply comes later (a script answers a granted run at its next
    boundary)."""

    job: int
    turn: Turn

    def run(self) -> Reply | None:
        """A `Run` granted the job one iteration."""

    def refuse(self, code: str, message: str) -> Reply | None:
        """Answer what waits with the error `code` and `message`."""

    def exit(self, code: str, message: str) -> Reply | None:
        """The daemon ended the job."""

    def place(self, device: str, message: Place) -> Reply:
        """Run on torch `device` from now on (the CUDA side is done: `on_place`)."""

    def swap_out(self) -> Reply:
        """Move the job's state to host memory."""

    def other(self, message: Request, request: Any) -> tuple[Reply | None, Any]:
        """Any other message, with the client's frame `request` (None: none came)."""


def on_lease(kind: JobKind, message: Lease, request: Any, cap: ProcessCap) -> Reply | None:
    """A lease granted answers a `Ready` still with the daemon: what waited goes on under it,
    and a `Run` the daemon sends for that `Ready` later is answered as `on_run` says (empty
    while leased). The job asks anew for what waits once the lease is taken back."""
    kind.turn.lease = message.granted
    if message.granted:
        kind.turn.asked = False
    return Ack()


def on_run(kind: JobKind, message: Run, request: Any, cap: ProcessCap) -> Reply | None:
    kind.turn.asked = False
    if kind.turn.lease:  # it already went on under a lease granted meanwhile
        return CallDone(False, 0.0, None, False, None, None, empty=True)
    kind.turn.granted = True
    return kind.run()


def on_refuse(kind: JobKind, message: Refuse, request: Any, cap: ProcessCap) -> Reply | None:
    kind.turn.asked = False
    return kind.refuse(message.code, message.message)


def on_exit(kind: JobKind, message: Exit, request: Any, cap: ProcessCap) -> Reply | None:
    cap.drop(kind.job)
    return kind.exit(message.code, message.message)


def on_place(kind: JobKind, message: Place, request: Any, cap: ProcessCap) -> Reply | None:
    """Place the job: the GPU this process sees (narrowed to the placed one while its CUDA has
    not started), an MPS client's limits, the process's cap with this job booked (before its
    state moves in, so the move itself is within the cap), then the kind's own move."""
    started = cuda_started()
    seen = device_for(message.device, message.uuid, cuda_started=started, environ=os.environ)
    lane = message.lane_bytes or 0
    cap.book(kind.job, seen, max(0, message.budget_bytes - lane), lane,
             message.workspace_bytes or 0)
    if message.mps is not None and not started:  # an MPS client from its CUDA's start, held
        # to its cap and its context (fixed then: a lane that grows later is not covered)
        os.environ.update(client_environment(
            message.mps, cap.bytes_on(seen) + (message.mps_limit_bytes or 0),
            message.mps_threads))
    return kind.place(seen, message)


def on_swap_out(kind: JobKind, message: SwapOut, request: Any,
                cap: ProcessCap) -> Reply | None:
    reply = kind.swap_out()
    cap.drop(kind.job)
    return reply


Handler = Callable[[Any, Any, Any, ProcessCap], Reply | None]
HANDLERS: dict[type, Handler] = {
    Lease: on_lease,
    Run: on_run,
    Refuse: on_refuse,
    Exit: on_exit,
    Place: on_place,
    SwapOut: on_swap_out,
}


def answer(kind: JobKind, message: Request, request: Any,
           cap: ProcessCap) -> tuple[Reply | None, Any]:
    """Act on one daemon message for the job `kind` hosts: (the reply, the client's answer to
    forward or None). A `Run` that carries the client's call (`request`) is the kind's own."""
    handler = HANDLERS.get(type(message))
    if handler is None or (isinstance(message, Run) and request is not None):
        return kind.other(message, request)
    return handler(kind, message, request, cap), None
