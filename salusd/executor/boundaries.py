"""A script job's iteration boundaries: where the running script meets the scheduler.

Every `torch.optim.Optimizer.step()` (a global step post hook, installed by `script.py` unless
`SALUS_BOUNDARY=explicit`) and every `salus.step()` is a boundary. The script's run between two
boundaries is one of the job's iterations, scheduled by the same turn as a direct call
(`turns.py`): while the job holds its lane's lease it goes on at once and what ran is reported
in batches (`Ran`); otherwise the executor asks (`Ready`), waits for `Run`, and answers it with
`CallDone` at the next boundary. Daemon messages are read at boundaries only, so a suspend, a
cancel or another job's turn takes effect there; a job the daemon ended stops its script at its
next boundary. A `suspend --swap` moves what the optimizers seen so far reach to host memory
there (`script_swap.py`).

On a GPU the job is placed before its first line runs, like any job (`turns.on_place`): the
executor sees only the placed GPU, and the process's cap is set as the script starts CUDA. At
each boundary where CUDA has started the device is synchronised, so an iteration's time is its
GPU work, and its peak is the allocator's reserved high-water mark since the last reading
(`DeviceMeter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from salus.daemon.devices.discovery import pinned_gpus
from salus.daemon.executor import turns
from salus.daemon.executor.cap import ProcessCap, started_cuda
from salus.daemon.executor.framework_memory import framework_memory_env
from salus.daemon.executor.on_import import imported
from salus.daemon.executor.peak import PeakMeter
from salus.daemon.executor.turns import Turn
from salus.daemon.wire.executor_ops import (
    Ack,
    CallDone,
    EstimateFailed,
    Exit,
    Exited,
    Failed,
    Place,
    Progress,
    Ran,
    Reply,
    Request,
    Script,
    Swapped,
    address_of,
    addressed,
    client_frame_follows,
    decode_request,
    encode,
)
from salus.daemon.wire.frames import ConnectionClosed
from salus.daemon.wire.json_channel import JsonChannel

if TYPE_CHECKING:
    from salus.daemon.executor.script_swap import ScriptSwap
    from salus.daemon.wire.channel import Channel

log = logging.getLogger("salusd.executor")
NO_ESTIMATE = ("a script job's iterations run in its own process and are measured as they run, "
               "not estimated on fake tensors")
NOT_REACHED = "the script has not imported torch: there is no optimizer state to move"


class DeviceMeter:
    """A script's peaks on its placed GPU: the allocator's reserved high-water mark, read and
    reset at boundaries once the script has started CUDA (nothing before: no context is made
    for a script that never uses the GPU, and none is read through torch before the script
    imports it)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def set_baseline(self) -> None:
        """Nothing was reserved before the script: its peaks are whole."""

    def settle(self) -> None:
        """Wait for the iteration's kernels, so that its end is the GPU's."""
        if (cuda := started_cuda()) is not None:
            cuda.synchronize(self.device)

    def start(self) -> None:
        if (cuda := started_cuda()) is not None:
            cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """Bytes reserved at most since `start` (0 before CUDA started)."""
        cuda = started_cuda()
        return 0 if cuda is None else int(cuda.max_memory_reserved(self.device))


class Boundaries:
    """The daemon's side of a running script: its turn in the lane at each boundary (the
    script's `turns.JobKind`)."""

    def __init__(self, daemon: Channel | JsonChannel, job: int, estimate: bool) -> None:
        self.daemon = daemon
        self.job = job  # every message names it (`wire/executor_ops/envelope.py`)
        self.pid = os.getpid()  # a process the script forked has no turn to ask for
        self.lock = threading.RLock()
        self.meter: PeakMeter | DeviceMeter = PeakMeter()
        self.turn = Turn()
        self.cap = ProcessCap()
        self.estimate = estimate  # the first `Ready` says why there is no estimate
        self.seen = 0  # boundaries so far
        self.began = time.monotonic()
        self.ended = False  # the script ended: a granted run has nothing to run
        # The caller's CUDA_VISIBLE_DEVICES (None: unset) and the daemon's GPUs by UUID.
        self.pin: tuple[str | None, str] = (None, "")
        self.main = threading.main_thread().ident
        self.inside = False  # the main thread is in a boundary: a Ctrl-C waits
        self.interrupted = False
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # stepped so far
        self.swap: ScriptSwap | None = None  # made at the first swap (it needs torch)

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
            self.ended = True
            self._send(Exited(code))

    def drain(self) -> str | None:
        """Answer the daemon until it lets the job go (`exit`, answered): the `Exit`'s code
        (`restarting`: the command runs again elsewhere), None when the daemon went away."""
        with self.lock:
            self.ended = True
            while True:
                try:
                    self._handle(self.daemon.recv())
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
        if not self.turn.lease or self.turn.ran is None:
            self.meter.start()

    def _end(self, counted: bool) -> None:
        """Report the iteration that ended (on a GPU, once its kernels have)."""
        if isinstance(self.meter, DeviceMeter):
            self.meter.settle()
        ended = time.monotonic()
        seconds = ended - self.began
        if not self.turn.may_go():
            return
        granted = self.turn.granted
        done = CallDone(True, seconds, self.meter.peak() if granted else None, counted,
                        self.began, ended)
        report = self.turn.done(done, ended)
        if report is not None:
            self._send(report if isinstance(report, CallDone) else self._with_peak(report))

    def _poll(self) -> None:
        """Handle what the daemon sent while the iteration ran (without waiting)."""
        while self.daemon.ready():
            self._report_ran()  # the daemon decides knowing what ran
            self._handle(self.daemon.recv())

    def _wait_turn(self) -> None:
        while not self.turn.may_go():
            ready = self.turn.ask(True, EstimateFailed(NO_ESTIMATE) if self.estimate else None)
            if ready is not None:
                self.estimate = False
                self._send(ready)
            self._report_ran()
            self._handle(self.daemon.recv())

    def _handle(self, meta: Any) -> None:
        """One daemon message; a frame that follows it (none is sent to a script job) is read
        and dropped so the stream stays in step."""
        if client_frame_follows(meta):
            self.daemon.recv()
        try:
            job = address_of(meta) if isinstance(meta, dict) else None
            message = decode_request(meta)
        except ValueError as exc:
            self._send(Failed(str(exc)[:2000]))
            return
        if isinstance(message, Exit) and job is None:  # the whole process
            raise _Stop(message.message, message.code)
        reply, _ = turns.answer(self, message, None, self.cap)
        if reply is not None:
            self._send(reply)

    # ---- what the turn's messages do to a script (`turns.JobKind`) --------------------------
    def run(self) -> Reply | None:
        """A granted run: answered at the next boundary, or at once when the script ended."""
        if self.ended:
            self.turn.granted = False
            return CallDone(False, 0.0, None, False, None, None, empty=True)
        return None

    def refuse(self, code: str, message: str) -> Reply | None:
        self._send(Ack())
        raise _Stop(message)

    def exit(self, code: str, message: str) -> Reply | None:
        if self.ended:  # let go: the supervisor hears it from the answer
            self._send(Ack())
        raise _Stop(message, code)

    def place(self, device: str, message: Place) -> Reply:
        """The script runs where it was placed from its first line (its executor sees only
        that GPU); placed again after a swap, what the swap moved goes back."""
        refused = pinned_elsewhere(*self.pin, message.uuid)
        if refused is not None:
            return Failed(refused)
        if device.startswith("cuda") and not isinstance(self.meter, DeviceMeter):
            self.meter = DeviceMeter(device)
            os.environ.update(framework_memory_env(device, message.budget_bytes,
                                                   message.total_bytes, os.environ))
        if self.swap is not None and self.swap.home:
            return Swapped(self.swap.back())
        return Ack()

    def swap_out(self) -> Reply:
        """`suspend --swap`: what the stepped optimizers reach, to host memory (nothing
        before the script imports torch)."""
        if imported("torch") is None:
            return Swapped({"optimizers": 0, "tensors": 0, "bytes": 0, "moved_bytes": 0,
                            "note": NOT_REACHED})
        if self.swap is None:
            from salus.daemon.executor.script_swap import ScriptSwap

            self.swap = ScriptSwap()
        return Swapped(self.swap.out(list(self.optimizers)))

    def other(self, message: Request, request: Any) -> tuple[Reply | None, Any]:
        if isinstance(message, Script):
            return Failed("this executor already runs a script"), None
        return Failed(f"a script job cannot {message.op!r}: it keeps its own state "
                      "(checkpoints: salus.resume_dir())"), None

    def _report_ran(self) -> None:
        if (ran := self.turn.report()) is not None:
            self._send(self._with_peak(ran))

    def _with_peak(self, ran: Ran) -> Ran:
        """A batch's peak is measured over all of it (one meter reset per batch)."""
        return dataclasses.replace(ran, peak=self.meter.peak())

    def _send(self, reply: Reply) -> None:
        self.daemon.send(addressed(encode(reply), self.job))


def pinned_elsewhere(pin: str | None, daemon_gpus: str, uuid: str | None) -> str | None:
    """Why a script whose caller set `CUDA_VISIBLE_DEVICES` to `pin` cannot run on the GPU
    `uuid` it was placed on, or None where the pin allows it (or there is none). The pin is
    read against the daemon's GPUs (`daemon_gpus`, its executors' `CUDA_VISIBLE_DEVICES`, by
    UUID in the daemon's order) as admission reads it (`devices.pinned_gpus`), which places a
    pinned script on a GPU it names; this is the executor's own check of that."""
    if pin is None or uuid is None:
        return None
    gpus = [g.strip() for g in daemon_gpus.split(",") if g.strip()]
    if uuid in [gpus[i] for i in pinned_gpus(pin, gpus)]:
        return None
    return (f"the script's CUDA_VISIBLE_DEVICES={pin!r} does not include {uuid}, the GPU salusd "
            "placed it on; salusd chooses the GPU and shows the script only that one: unset "
            "CUDA_VISIBLE_DEVICES, or pin a GPU the daemon serves")


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
