"""The one fake executor for engine tests: the engine's `ExecutorPort`, speaking the real
daemon↔executor protocol (`salusd/wire/executor_ops.py`) without processes.

Every message the engine sends goes through its wire form (`encode`, then `decode_request`),
so one the protocol cannot carry fails the test where it is sent. Each `FakeExecutor` keeps
what it was sent (`sent`) and what it has not answered yet (`unanswered`, with the engine's
`Sent`, which goes back with the reply as the supervisor's queue gives it); a test answers the
oldest with a typed reply, or as a healthy executor would (`answer`, `answer_all`; see
`ordinary_reply`), sends unsolicited `Ready`/`Ran` (`ready`, `unsolicited`), and kills one
(`die`). Replies go through their wire
form too (`encode`, then `decode_reply`, as the supervisor reads them), and a reply that does
not fit its request (a `CallDone` for a `Load`) fails the test.

Like the real executor, the fake decides whether a call is an iteration itself, with the
executor's own rule (`is_iteration`) over the functions it was sent (`Define` frames) and the
call's frame, not from the daemon's `Run.counted`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.ports import Sent
from salus.daemon.engine.registry import JobRecord
from salus.daemon.executor.results import is_iteration
from salus.daemon.wire.executor_ops import (
    Ack,
    Attach,
    Attached,
    CallDone,
    Checkpoint,
    Checkpointed,
    Define,
    DirectChannel,
    Estimate,
    Estimated,
    EstimateFailed,
    Failed,
    Load,
    Loaded,
    Place,
    Placed,
    Pull,
    Ran,
    Ready,
    Reply,
    Request,
    Restore,
    Run,
    Step,
    StepDone,
    SwapOut,
    Swapped,
    decode_reply,
    decode_request,
    encode,
)
from salus.daemon.wire.frames import RawFrame, json_frame

_FITS: dict[type, tuple[type, ...]] = {
    Run: (CallDone,), Step: (StepDone,), Estimate: (Estimated, EstimateFailed),
    Attach: (Attached, Failed), Load: (Loaded, Failed), Restore: (Loaded, Failed),
    Checkpoint: (Checkpointed, Failed), Place: (Ack, Placed, Swapped, Failed),
    SwapOut: (Ack, Swapped, Failed),
}
"""The replies each request may get (any other request: `Ack` or `Failed`)."""


class FakeExecutor:
    """One executor of job `record`: what it was sent and how it answers by default (sizes in
    bytes, seconds)."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record
        self.sent: list[Request] = []  # every message, in order
        #: with the client's frame's JSON and the engine's record of the message
        self.unanswered: deque[tuple[Request, Any, Sent]] = deque()
        self.kinds: dict[int, str] = {}  # the job's functions by id, from `Define` frames
        self.direct: deque[Any] = deque()  # direct calls waiting for a `Run` without a frame
        self.device: str | None = None  # where the last `Place` put it
        self.retired: tuple[str, str] | None = None  # the code and message it was retired with
        self.persistent_bytes = 1 << 19
        self.ephemeral_bytes = 1 << 20
        self.seconds = 0.01
        self.peaks: deque[int | None] = deque()  # the next calls' peaks, then `peak`
        self.peak: int | None = None
        self.runs = 0  # calls and steps answered
        self.iterations = 0  # of them, iterations

    def ordinary_reply(self, request: Request, call: Any) -> Reply:
        """The reply of a healthy executor to `request` (`call`: the client's frame's JSON)."""
        if isinstance(request, Attach):
            return Attached(self.persistent_bytes, 1, forward=True)
        if isinstance(request, Load | Restore):
            return Loaded(self.persistent_bytes, self.iterations)
        if isinstance(request, Estimate):
            return Estimated(self.ephemeral_bytes, "fake-tensor")
        if isinstance(request, Checkpoint):
            return Checkpointed(self.iterations, self.persistent_bytes, 0.001,
                                f"{request.dir}/{self.iterations}", 0.0)
        if isinstance(request, Step):
            self.runs += 1
            self.iterations += is_iteration(None, self.kinds)
            return StepDone(True, self.seconds, self._peak(), is_iteration(None, self.kinds),
                            0.0, self.seconds, self.iterations, loss=1.0)
        if isinstance(request, Run):
            if request.frame is False:
                if not self.direct:
                    return CallDone(False, 0.0, None, False, None, None, empty=True)
                call = self.direct.popleft()
            counted = is_iteration(call, self.kinds)
            self.runs += 1
            self.iterations += counted
            return CallDone(True, self.seconds, self._peak(), counted, 0.0, self.seconds,
                            forward=request.frame is not False)
        if isinstance(request, Define):
            self.kinds[call["fid"]] = call["kind"]
        return Ack(forward=isinstance(request, Define | Pull | DirectChannel))

    def _peak(self) -> int | None:
        return self.peaks.popleft() if self.peaks else self.peak


class FakeExecutors:
    """The engine's `ExecutorPort` over `FakeExecutor`s; `engine` is set once the engine that
    uses it is made. `on_send` (if set) sees each message as it is sent."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.executors: list[FakeExecutor] = []
        self.killed: list[FakeExecutor] = []
        self.signalled: list[tuple[FakeExecutor, int]] = []
        self.on_send: Callable[[FakeExecutor, Request], None] | None = None

    # ---- ExecutorPort -------------------------------------------------------------------------
    def acquire(self, record: JobRecord, cwd: str | None, replica: int = 0) -> FakeExecutor:
        executor = FakeExecutor(record)
        self.executors.append(executor)
        return executor

    def send(self, executor: object, sent: Sent, frame: RawFrame | None) -> None:
        assert isinstance(executor, FakeExecutor)
        msg = sent.request
        request = decode_request(encode(msg))
        assert request == msg, f"{msg} does not come through the wire as itself: {request}"
        executor.sent.append(request)
        if isinstance(request, Place):
            executor.device = request.device
        executor.unanswered.append((request, None if frame is None else frame.json(), sent))
        if self.on_send is not None:
            self.on_send(executor, request)

    def kill(self, executor: object) -> None:
        assert isinstance(executor, FakeExecutor)
        self.killed.append(executor)

    def send_signal(self, executor: object, signum: int) -> None:
        assert isinstance(executor, FakeExecutor)
        self.signalled.append((executor, signum))

    def retire(self, executor: object, code: str = "job_cancelled",
               message: str = "the job ended") -> None:
        """The executor answers what it was sent before and exits; its death is reported only
        when the test calls `die`."""
        assert isinstance(executor, FakeExecutor)
        executor.retired = (code, message)

    # ---- the executors' side ------------------------------------------------------------------
    def answer(self, executor: FakeExecutor, reply: Reply | None = None,
               frame: RawFrame | None = None) -> Request:
        """Answer `executor`'s oldest message with `reply` (default: its `ordinary_reply`) and,
        when the reply forwards one, the client's `frame` (default: an ok result); returns the
        message answered."""
        request, call, sent = executor.unanswered.popleft()
        if reply is None:
            reply = executor.ordinary_reply(request, call)
        fits = _FITS.get(type(request), (Ack, Failed))
        assert isinstance(reply, fits), f"{type(request).__name__} answered with {reply}"
        if reply.forward and frame is None:
            frame = json_frame({"ok": True, "result": None})
        assert reply.forward == (frame is not None), "a frame goes with forward replies only"
        self._engine().on_executor_reply(executor, _wired(reply), frame, sent)
        return request

    def answer_all(self, limit: int = 10_000) -> None:
        """Answer every message, and those the answers cause, oldest executor first."""
        for _ in range(limit):
            executor = next((e for e in self.executors if e.unanswered), None)
            if executor is None:
                return
            self.answer(executor)
        raise AssertionError("the engine kept sending")

    def ready(self, executor: FakeExecutor, call: dict[str, Any],
              estimate: Estimated | EstimateFailed | None = None) -> None:
        """A direct call (`call`: its frame's JSON) arrived without a lease: ask to run it."""
        executor.direct.append(call)
        self.unsolicited(executor, Ready(is_iteration(call, executor.kinds), estimate))

    def unsolicited(self, executor: FakeExecutor, message: Ready | Ran) -> None:
        self._engine().on_executor_reply(executor, _wired(message), None, None)

    def die(self, executor: FakeExecutor, reason: str, poisoned: bool = False) -> None:
        """The executor process is gone (its death reported, as the supervisor does;
        `poisoned`: a call poisoned its CUDA context)."""
        owed = [sent for _, _, sent in executor.unanswered]
        executor.unanswered.clear()
        self._engine().on_executor_died(executor, reason, None, True, poisoned, owed)

    def _engine(self) -> Engine:
        assert self.engine is not None, "set FakeExecutors.engine to the engine using it"
        return self.engine


def _wired(reply: Reply) -> Reply:
    """`reply` as the supervisor reads it off the wire (and the same reply)."""
    read = decode_reply(encode(reply))
    assert read == reply, f"{reply} does not come through the wire as itself: {read}"
    return read
