"""A script job's iteration boundaries: where the running script meets the scheduler.

Every `torch.optim.Optimizer.step()` (a global step post hook, installed by `script.py` unless
`SALUS_BOUNDARY=explicit`) and every `salus.step()` is a boundary. The script's run between two
boundaries is one of the job's iterations, scheduled as a direct call is: while the job holds
its lane's lease it goes on at once and what ran is reported in batches (`Ran`); otherwise the
executor asks (`Ready`), waits for `Run`, and answers it with `CallDone` at the next boundary.
Daemon messages are read at boundaries only, so a suspend, a cancel or another job's turn takes
effect there; a job the daemon ended stops its script at its next boundary. A `suspend --swap`
moves what the optimizers seen so far reach to host memory there (`script_swap.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import sys
import threading
import time
import weakref
from typing import Any

from salus.daemon.executor.peak import PeakMeter
from salus.daemon.executor.script_swap import ScriptSwap
from salus.daemon.executor.slot import REPORT_EVERY_S, RanSoFar
from salus.daemon.wire.channel import Channel, ConnectionClosed
from salus.daemon.wire.executor_ops import (
    Ack,
    CallDone,
    EstimateFailed,
    Exit,
    Exited,
    Failed,
    Lease,
    Place,
    Progress,
    Ready,
    Refuse,
    Reply,
    Run,
    Script,
    SwapOut,
    Swapped,
    address_of,
    addressed,
    client_frame_follows,
    decode_request,
    encode,
)

log = logging.getLogger("salusd.executor")
NO_ESTIMATE = ("a script job's iterations run in its own process and are measured as they run, "
               "not estimated on fake tensors")


class Boundaries:
    """The daemon's side of a running script: its turn in the lane at each boundary."""

    def __init__(self, daemon: Channel, job: int, estimate: bool) -> None:
        self.daemon = daemon
        self.job = job  # every message names it (`wire/executor_ops/envelope.py`)
        self.pid = os.getpid()  # a process the script forked has no turn to ask for
        self.lock = threading.RLock()
        self.meter = PeakMeter()
        self.lease = False
        self.asked = False
        self.granted = False  # a `Run` was received: its `CallDone` is sent at the boundary
        self.estimate = estimate  # the first `Ready` says why there is no estimate
        self.seen = 0  # boundaries so far
        self.began = time.monotonic()
        self.ran: RanSoFar | None = None
        self.main = threading.main_thread().ident
        self.inside = False  # the main thread is in a boundary: a Ctrl-C waits
        self.interrupted = False
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # stepped so far
        self.swap = ScriptSwap()

    def start(self) -> None:
        """Before the script's first line: wait for the job's first turn."""
        self.meter.set_baseline()
        self._turn(first=True)

    def boundary(self) -> None:
        """An iteration ended: report it, then go on at once under a lease, or wait for the
        job's next turn."""
        if os.getpid() == self.pid:
            self._turn(first=False)

    def stepped(self, optimizer: Any, boundary: bool) -> None:
        """An optimizer stepped (the global step post hook): `suspend --swap` reaches it from
        now on; with `boundary`, its step ends an iteration."""
        self.optimizers.add(optimizer)
        if boundary:
            self.boundary()

    def on_sigint(self, signum: int, frame: object) -> None:
        """The script's SIGINT handler (a Ctrl-C): a KeyboardInterrupt, as the interpreter's
        own handler raises, except during a boundary, where it is raised when the boundary
        returns (as if it came in the optimizer step), never in the middle of a message to
        the daemon."""
        if self.inside:
            self.interrupted = True
        else:
            raise KeyboardInterrupt

    def _turn(self, first: bool) -> None:
        main = threading.get_ident() == self.main
        with self.lock:
            self.inside = self.inside or main
            try:
                if not first:
                    self.seen += 1
                    self._end(counted=True)
                    self._poll()
                self._wait_turn()
                self._begin()
            except (_Stop, ConnectionClosed) as stop:  # the daemon ended the job meanwhile
                flush()
                log.info("script stopped: %s", stop)
                os._exit(1)
            finally:
                self.inside = self.inside and not main
        if main and self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt

    def progress(self, step: int, max_steps: int | None, loss: float | None) -> None:
        if os.getpid() == self.pid:
            with self.lock:
                self._send(Progress(step, max_steps, loss))

    def exited(self, code: int) -> None:
        """The script ended with exit status `code`: report its last part and the status."""
        with self.lock:
            self._end(counted=self.seen == 0)
            self._report_ran()
            self._send(Exited(code))

    def drain(self) -> str | None:
        """Answer the daemon until it lets the job go (`exit`, answered): the `Exit`'s code
        (`restarting`: the command runs again elsewhere), None when the daemon went away."""
        with self.lock:
            while True:
                try:
                    self._handle(self.daemon.recv(), ended=True)
                except _Stop as stop:
                    return stop.code
                except (ConnectionClosed, OSError):
                    return None

    # ---- the turn protocol ----------------------------------------------------------------
    def _begin(self) -> None:
        """An iteration begins. Its memory peak is measured on its own when it runs on request;
        under a lease, over each batch reported together (`Ran` says their largest), which
        spares a reset of the meter per iteration."""
        self.began = time.monotonic()
        if not self.lease or self.ran is None:
            self.meter.start()

    def _end(self, counted: bool) -> None:
        """Report the iteration that ended."""
        ended = time.monotonic()
        seconds = ended - self.began
        if self.granted:
            self.granted = False
            self._send(CallDone(True, seconds, self.meter.peak(), counted, self.began, ended))
        elif self.lease:
            if self.ran is None:
                self.ran = RanSoFar(ended, self.began)
            self.ran.add(CallDone(True, seconds, None, counted, self.began, ended))
            if ended - self.ran.since >= REPORT_EVERY_S:
                self._report_ran()

    def _poll(self) -> None:
        """Handle what the daemon sent while the iteration ran (without waiting)."""
        sock = self.daemon.sock
        while self.daemon.buffered() or select.select([sock], [], [], 0)[0]:
            self._report_ran()  # the daemon decides knowing what ran
            self._handle(self.daemon.recv())

    def _wait_turn(self) -> None:
        while not (self.lease or self.granted):
            if not self.asked:
                self.asked = True
                estimate = EstimateFailed(NO_ESTIMATE) if self.estimate else None
                self.estimate = False
                self._send(Ready(True, estimate))
            self._report_ran()
            self._handle(self.daemon.recv())

    def _handle(self, meta: Any, ended: bool = False) -> None:
        """One daemon message (`ended`: the script has ended); a frame that follows it (none
        is sent to a script job) is read and dropped so the stream stays in step."""
        if client_frame_follows(meta):
            self.daemon.recv()
        try:
            job = address_of(meta) if isinstance(meta, dict) else None
            message = decode_request(meta)
        except ValueError as exc:
            self._send(Failed(str(exc)[:2000]))
            return
        match message:
            case Exit() if job is None:  # the whole process
                raise _Stop(message.message, message.code)
            case Exit():
                if ended:  # let go: the supervisor hears it from the answer
                    self._send(Ack())
                raise _Stop(message.message, message.code)
            case Lease(granted=granted):
                self.lease = granted
                self._send(Ack())
            case Run():
                self.asked = False
                if self.lease or ended:  # it went on under a lease granted meanwhile, or the
                    # script ended: nothing to run
                    self._send(CallDone(False, 0.0, None, False, None, None, empty=True))
                else:
                    self.granted = True
            case Refuse(message=text):
                self._send(Ack())
                raise _Stop(text)
            case Script():
                self._send(Failed("this executor already runs a script"))
            case SwapOut():  # suspend --swap: what the stepped optimizers reach, to the host
                self._send(Swapped(self.swap.out(list(self.optimizers))))
            case Place() if self.swap.home:  # placed again after a swap: moved back
                self._send(Swapped(self.swap.back()))
            case Place():  # the script chose its device itself: nothing is placed for it
                self._send(Ack())
            case _:
                self._send(Failed(f"a script job cannot {message.op!r}: it keeps its own "
                                  "state (checkpoints: salus.resume_dir())"))

    def _report_ran(self) -> None:
        if self.ran is not None:
            ran, self.ran = self.ran, None  # the batch's peak, measured over all of it
            self._send(dataclasses.replace(ran.report(), peak=self.meter.peak()))

    def _send(self, reply: Reply) -> None:
        self.daemon.send(addressed(encode(reply), self.job))


class _Stop(BaseException):
    """The daemon ended the job (cancel, shutdown): the script stops here. `code`: the
    `Exit`'s."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def flush() -> None:
    """Flush the script's text streams (what it printed goes out before the process ends)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
