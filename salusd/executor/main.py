"""An executor's loop: the daemon's messages and the jobs' direct calls, one job's code at a time.

The process starts in `process.py`; each job's turn in its lane (lease, `Ready`, `Run`, place)
follows `turns.py`, the same for every job kind; a script job's own loop is its script
(`script.py`, `boundaries.py`). The messages, their replies and their wire form are
`salusd/wire/executor_ops/`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import time
from dataclasses import replace
from typing import Any

import torch

from salus.daemon.executor import handover, output, script, turns
from salus.daemon.executor.calls import (
    Answered,
    answer_call,
    call_done,
    error_reply,
    estimate_call,
    is_report,
    unsendable,
)
from salus.daemon.executor.cap import ProcessCap
from salus.daemon.executor.contract import Contract
from salus.daemon.executor.cuda_call import make_room
from salus.daemon.executor.output import HOLD_S
from salus.daemon.executor.process import become
from salus.daemon.executor.results import error_text, is_iteration
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.executor.slot import Slot
from salus.daemon.executor.spin import spin_window_s
from salus.daemon.executor.zygote import die_with_parent
from salus.daemon.wire.channel import (
    Channel,
    ConnectionClosed,
    FrameError,
    Pickled,
    passed_fd,
    spin,
)
from salus.daemon.wire.executor_ops import (
    Ack,
    Adopt,
    Become,
    CallDone,
    Exit,
    Failed,
    HandedOver,
    Host,
    Poisoned,
    Ran,
    Reply,
    Script,
    address_of,
    addressed,
    client_frame_follows,
    decode_request,
    encode,
)

log = logging.getLogger("salusd.executor")
MAX_QUEUED_CALLS = 64
_BUSY = "busy"  # a call refused for the bound, answered in its turn (requests are never str)


class Executor:
    """The loop of one executor process: messages from the daemon, each for one of the jobs
    it hosts (`Slot`), and calls from those jobs' clients on their direct channels.

    A direct call runs at once while the daemon has granted its job the lane (`lease`) and the
    daemon hears of it afterwards (`ran`); without a lease the executor asks (`ready`) and runs
    the call when the daemon answers `run`. Either way a lane runs one call at a time and the
    scheduler decides at every boundary where it must: the daemon grants a lease only to a job
    alone in its lane, and takes it back (`lease` false) before anything else may run there.
    The process runs one call at a time whichever job it is for.
    """

    def __init__(self, sock: socket.socket, zygote: int | None = None) -> None:
        self.zygote = zygote  # the parent to die with (None: not forked by the zygote)
        self.daemon = Channel(sock)
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "daemon")
        self.slots: dict[int, Slot] = {}
        self.current: Slot | None = None  # whose random state, directory and output are in
        self.spin_s = spin_window_s()  # poll this long after a message before blocking
        self.active_at = 0.0
        self.streams: output.Streams | None = None
        self.cap = ProcessCap()  # what the jobs placed here may reserve on their devices
        self.poisoned: Slot | None = None  # whose call left a sticky CUDA error: we end

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
        self.streams = output.install()
        while True:
            sources: list[object] = ["daemon"] if self.daemon.buffered() else []
            sources += [slot.job for slot in self.slots.values()
                        if slot.data is not None and slot.data.buffered()]
            if not sources:
                self._release_held()  # nothing to run at once: the client has all results
                sources = self._spin()
            if not sources:
                sources = [key.data for key, _ in self.selector.select(self._report_due())]
                if not sources:
                    self._report_ran()
            for source in sources:
                if source == "daemon":
                    self._release_held()
                    self._report_ran()  # the daemon decides knowing what ran
                    if self._from_daemon():
                        return 0
                elif type(source) is int and (slot := self.slots.get(source)) is not None:
                    self._from_client(slot)
            self._run_queued()
            if self.poisoned is not None:
                self._end_poisoned(self.poisoned)
                return 1
            self.active_at = time.perf_counter()

    def _spin(self) -> list[object]:
        """The sources that became readable while polling, without sleeping, for `spin_s` after
        the last message (`spin.py`)."""
        ready = spin(lambda: self.selector.select(0), self.active_at + self.spin_s)
        return [key.data for key, _ in ready or ()]

    def _report_due(self) -> float | None:
        """Seconds until the oldest unreported leased call must be reported (None: none)."""
        now = time.monotonic()
        due = [d for slot in self.slots.values() if (d := slot.turn.report_due(now)) is not None]
        return min(due, default=None)

    def _switch(self, slot: Slot) -> None:
        """Make `slot`'s job the one whose code runs: its CPU random generator, working
        directory, output and process group in; the peak meter's baseline taken with every
        job's state."""
        previous = self.current
        if previous is slot:
            return
        slot.group.enter()
        if previous is not None:
            previous.rng = torch.get_rng_state()
        if slot.rng is not None:
            torch.set_rng_state(slot.rng)
            slot.rng = None
        if slot.cwd is not None and (previous is None or previous.cwd != slot.cwd):
            with contextlib.suppress(OSError):
                os.chdir(slot.cwd)
        assert self.streams is not None
        self.streams.use(slot.sink)
        if previous is not None:
            make_room(slot.runtime.cuda, slot.lane_bytes, self.cap)
            slot.runtime.take_baseline()
        self.current = slot

    # ---- the daemon's messages ----------------------------------------------------------------
    def _from_daemon(self) -> bool:
        """Handle one message from the daemon; True when the process must exit."""
        try:
            meta = self.daemon.recv()
            request = self.daemon.recv() if client_frame_follows(meta) else None
            adopting = isinstance(meta, dict) and meta.get("op") == "adopt"
            sock = (self.daemon.recv() if adopting and meta.get("channel") is True else None)
            pool = (self.daemon.recv() if adopting and meta.get("pool") is True else None)
        except ConnectionClosed:
            for each in self.slots.values():
                self._refuse_queued(each, "unavailable", "salusd went away")
            return True
        job = None
        try:
            job = address_of(meta) if isinstance(meta, dict) else None
            message = decode_request(meta)
        except ValueError as exc:
            with_frame = client_frame_follows(meta)
            self._reply(job, Failed(str(exc)[:2000], forward=with_frame),
                        error_reply(exc) if with_frame else None)
            return False
        if job is None:
            if isinstance(message, Exit):  # the whole process
                for each in list(self.slots.values()):
                    self._refuse_queued(each, message.code, message.message)
                return True
            self._reply(None, Failed(f"{message.op!r} must name its job"), None)
            return False
        slot = self.slots.get(job)
        if isinstance(message, Host | Adopt):
            self._host(job, message, request, sock, pool)
            return False
        if slot is None:
            with_frame = request is not None
            self._reply(job, Failed(f"this executor hosts no job {job}", forward=with_frame),
                        error_reply(LookupError(f"no job {job} here")) if with_frame else None)
            return False
        if isinstance(message, Script):  # a script job: this process runs it to its end
            slot.group.end()  # its command runs in the executor's own group (`job_group.py`)
            return script.run(self.daemon, message, request, job, not slot.estimated,
                              slot.log, slot.cwd)
        reply, forward = turns.answer(Contract(self, slot), message, request, self.cap)
        if reply is not None:
            self._reply(job, reply, forward)
        return False

    def _host(self, job: int, message: Host | Adopt, request: Any, sock: Any,
              pool: Any = None) -> None:
        """Start hosting a new job (`Host`), or one another executor handed over (`Adopt`)."""
        assert self.streams is not None
        if job in self.slots:
            self._reply(job, Failed(f"this executor already hosts job {job}",
                                    forward=isinstance(message, Adopt)), None)
            return
        if isinstance(message, Host):
            self.slots[job] = Slot(job, JobRuntime(), self.streams.sink(message.log),
                                   message.cwd, message.log, not message.estimate)
            self._reply(job, Ack(), None)
            return
        try:
            slot = handover.adopt(job, request, self.streams, self._switch)
        except Exception as exc:
            for fd in (passed_fd(sock), passed_fd(pool)):
                if fd is not None:
                    os.close(fd)
            self._reply(job, Failed(error_text(exc)[:2000]), None)
            return
        self.slots[job] = slot
        channel_fd, pool_fd = passed_fd(sock), passed_fd(pool)
        if channel_fd is not None:
            self._attach_channel(slot, channel_fd)
            if slot.data is not None and pool_fd is not None:
                slot.data.adopt_pool(pool_fd)
        self._reply(job, Ack(), None)

    def _handover(self, slot: Slot) -> None:
        """Give the job up: its bundle (state, generator, waiting calls) and its channel's
        socket go to the daemon, which hands them to the owner's executor of its lane. A job
        whose state cannot be pickled again stays, and the reply says why."""
        self._report_ran()
        while slot.data is not None and slot.data.buffered():
            # Frames this process already read off the socket go along as queued calls; the
            # socket itself carries on from the first byte not read (a client that keeps
            # calls in flight has sent several).
            self._from_client(slot)
        self._switch(slot)
        try:
            bundle = handover.bundle(slot)
            channel = slot.data is not None
            pool = slot.data.pool_descriptor() if slot.data is not None else None
            self.daemon.send_many([
                addressed(encode(HandedOver(True, channel, pool=pool is not None)), slot.job),
                {"bundle": Pickled(bundle, "the job's state")}])
        except (TypeError, ValueError) as exc:
            self._reply(slot.job, HandedOver(False, False, error_text(exc)[:2000]), None)
            return
        if slot.data is not None:
            slot.data.give_back(leaving=True)  # the bundle carries a copy of what was lent
            self.daemon.send_socket({"op": "channel"}, slot.data.sock.fileno())
            if pool is not None:  # the client's shared memory for large tensors goes along
                self.daemon.send_socket({"op": "pool"}, pool)
        self.cap.drop(slot.job)
        self._drop(slot)  # the socket went with the bundle: closing this copy leaves it open

    def _drop(self, slot: Slot) -> None:
        """Stop hosting the job; its client's channel closes here unless it was handed on, and
        the processes its code started here end (they cannot follow it to another process)."""
        slot.group.end()
        self._close_channel(slot)
        self.slots.pop(slot.job, None)
        assert self.streams is not None
        self.streams.drop(slot.sink)
        if self.current is slot:
            self.current = None

    def _after_call(self, slot: Slot) -> None:
        """Where other processes run in the job's lane, give the cached device memory back at
        the end of each call, so the lane holds only the running process's blocks (the next
        call in the lane may be another process's, which cannot take them from this cache).
        A call that left a sticky CUDA error ends the process (`_end_poisoned`)."""
        if slot.runtime.poisoned is not None:
            self.poisoned = self.poisoned or slot
        elif slot.shared_lane and slot.runtime.device.type == "cuda":
            torch.cuda.empty_cache()

    def _end_poisoned(self, slot: Slot) -> None:
        """A call of `slot`'s job left the CUDA context unusable: say so, then fail every call
        still waiting here; the process ends and its jobs fail with the reason."""
        reason = slot.runtime.poisoned or "a sticky CUDA error"
        log.error("job %s hit a sticky CUDA error, the executor ends: %s", slot.job, reason)
        self._report_ran()
        _send(self.daemon, Poisoned(reason[:2000]), None, slot.job)
        for other in self.slots.values():
            self._refuse_queued(other, "unavailable", "the job's executor ended: its CUDA "
                                f"context was poisoned by a call of job {slot.job} ({reason})")

    def _open_channel(self, slot: Slot, request: Any) -> None:
        fd = passed_fd(request)
        if fd is None:
            self._reply(slot.job, Failed(None, forward=True),
                        error_reply(ValueError("'channel' needs a socket")))
            return
        if slot.data is not None:
            os.close(fd)
            self._reply(slot.job, Failed(None, forward=True),
                        error_reply(ValueError("the job already has a channel")))
            return
        self._attach_channel(slot, fd)
        self._reply(slot.job, Ack(forward=True), {"ok": True, "result": None})

    def _attach_channel(self, slot: Slot, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        slot.data = Channel(sock, borrow=True)  # a call's large arguments view the pool
        self.selector.register(sock, selectors.EVENT_READ, slot.job)
        slot.sink.attach(slot.data)

    def _reply(self, job: int | None, reply: Reply, forward: Any) -> None:
        try:
            _send(self.daemon, reply, forward, job)
        except TypeError as exc:  # a result that cannot be pickled fails its call only
            failed = (replace(reply, ok=False) if isinstance(reply, CallDone)
                      else Failed(None, forward=True))
            _send(self.daemon, failed, unsendable(exc), job)

    # ---- the clients' direct calls ------------------------------------------------------------
    def _from_client(self, slot: Slot) -> None:
        """Read the client's next call, and every further one already read off its socket:
        a client that keeps calls in flight sent several, and running them back to back keeps
        the job's step on warm caches (docs/runtime.md, "Packing")."""
        self._read_call(slot)
        while slot.data is not None and slot.data.frame_buffered():
            self._read_call(slot)

    def _read_call(self, slot: Slot) -> None:
        assert slot.data is not None
        try:
            lending = slot.data.lending
            request = slot.data.recv()
            if len(slot.queue) < MAX_QUEUED_CALLS:
                slot.queue.append(request)
                if slot.data.lending and not lending:  # its arguments view the client's pool
                    slot.lender = id(request)
            else:
                slot.queue.append(_BUSY)
        except (ConnectionClosed, OSError):
            self._close_channel(slot)
        except FrameError as exc:
            self._answer_client(slot, {"ok": False, "code": exc.code, "message": str(exc)})
            if not exc.recoverable:
                self._close_channel(slot)

    def _close_channel(self, slot: Slot) -> None:
        if slot.data is not None:
            slot.sink.detach()
            self.selector.unregister(slot.data.sock)
            slot.data.close()
            slot.data = None
        slot.queue.clear()
        slot.lender = None

    def _answer_at_head(self, slot: Slot) -> None:
        """Answer what waits at the head of the queue and is no call: a call refused for the
        bound (`_BUSY`), or a client's request to report now what its job ran (`is_report`),
        which `Job.info` sends when the daemon's count lags the client's."""
        while slot.queue and (isinstance(slot.queue[0], str) or is_report(slot.queue[0])):
            if is_report(slot.next_call()):
                self._report_ran()  # sent before the answer: the daemon has it first
                self._answer_client(slot, {"ok": True, "result": None})
                continue
            self._answer_client(slot, {"ok": False, "code": "busy", "message": (
                f"the job already has {MAX_QUEUED_CALLS} calls queued; wait for results "
                "before submitting more")})

    def _run_queued(self) -> None:
        for slot in list(self.slots.values()):
            self._run_queued_of(slot)
            slot.give_back()

    def _run_queued_of(self, slot: Slot) -> None:
        self._answer_at_head(slot)
        while slot.queue and slot.turn.lease and self.poisoned is None:
            self._switch(slot)
            # The client's reply first, the daemon's accounting after it (3-8 µs less per call
            # on the build VM, bench/call_stages.py `back`, one-off A/B runs).
            lent = id(slot.queue[0]) == slot.lender
            request = slot.next_call()
            reply, ran = answer_call(slot.runtime, request)
            if slot.runtime.retry:
                slot.turn.lease = False  # the daemon places the job anew before it runs again
                self._retry(slot, request, lent, ran)
                break
            del request  # (its arguments may view the client's pool: see `Slot.give_back`)
            slot.give_back(before_reply=True)
            self._answer_client(slot, reply, hold=ran.seconds < HOLD_S)
            del reply  # (it may view an argument lent out of the client's pool)
            slot.give_back()
            self._after_call(slot)
            report = slot.turn.done(call_done(slot.runtime, ran, forward=False))
            if report is not None:
                _send(self.daemon, report, None, slot.job)
            self._answer_at_head(slot)
        if (slot.queue and not slot.turn.may_go() and not slot.turn.asked
                and self.poisoned is None):
            estimate = None
            if not slot.estimated:
                slot.estimated = True
                self._switch(slot)
                estimate = estimate_call(slot.runtime, slot.queue[0])
            ready = slot.turn.ask(is_iteration(slot.queue[0], slot.runtime.kinds), estimate)
            if ready is not None:
                _send(self.daemon, ready, None, slot.job)

    def _report_ran(self) -> None:
        for slot in self.slots.values():
            if (ran := slot.turn.report()) is not None:
                _send(self.daemon, ran, None, slot.job)

    def _answer_client(self, slot: Slot, reply: Any, hold: bool = False) -> None:
        """Send `reply` on the job's line (`Slot.answer`); a line that broke is closed."""
        if not slot.answer(reply, hold):
            self._close_channel(slot)

    def _release_held(self) -> None:
        for slot in self.slots.values():
            slot.sink.release()
            slot.give_back()

    def _refuse_queued(self, slot: Slot, code: str, message: str) -> None:
        error = {"ok": False, "code": code, "message": message}
        while slot.queue:
            slot.next_call()
            self._answer_client(slot, error)
        slot.turn.asked = False
        slot.give_back()

    def _retry(self, slot: Slot, request: Any, lent: bool, ran: Answered) -> CallDone:
        """The call ran out of device memory with the job's state intact: it goes back to the
        head of the queue, unanswered, and runs again once the daemon, told at once (`oom`),
        has placed the job in a bigger lane (or fails it where none fits)."""
        slot.runtime.rewind()
        slot.queue.appendleft(request)
        if lent:
            slot.lender = id(request)
        done = call_done(slot.runtime, ran._replace(counted=False), forward=False)
        report = slot.turn.done(done)
        if isinstance(report, Ran):  # under a lease: reported at once (`Turn.done`)
            _send(self.daemon, report, None, slot.job)
        return done

    def _run_granted(self, slot: Slot) -> CallDone:
        """The daemon granted the call at the head of the job's queue its turn: run it (the
        client's reply first, then the daemon's `CallDone`)."""
        self._answer_at_head(slot)
        if not slot.queue:  # it already ran under a lease granted meanwhile
            slot.turn.granted = False
            return CallDone(False, 0.0, None, False, None, None, empty=True)
        self._switch(slot)
        lent = id(slot.queue[0]) == slot.lender
        request = slot.next_call()
        reply, ran = answer_call(slot.runtime, request)
        if slot.runtime.retry:
            return self._retry(slot, request, lent, ran)
        del request  # (its arguments may view the client's pool: see `Slot.give_back`)
        done = call_done(slot.runtime, ran, forward=False)
        self._after_call(slot)
        slot.give_back(before_reply=True)
        self._answer_client(slot, reply)
        del reply
        slot.give_back()
        owed = slot.turn.done(done)
        assert isinstance(owed, CallDone)
        return owed


def serve(sock: socket.socket, zygote: int | None = None) -> int:
    """The executor's loop until the daemon says `exit` or goes away; returns the exit code.
    `zygote`: the pid of the zygote that forked it, to die with."""
    return Executor(sock, zygote).serve()


def _send(channel: Channel, reply: Reply, forward: Any, job: int | None) -> None:
    meta = encode(reply) if job is None else addressed(encode(reply), job)
    channel.send_many([meta] if forward is None else [meta, forward])
