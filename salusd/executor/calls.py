"""A contract or batch job's calls in its runtime: a client's call run and what the daemon is
told of it (`CallDone`), a first call's estimate, and the job's other requests (attach, define,
pull, load, restore, checkpoint). The executor's loop (`main.py`) decides when each runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from salus.daemon.executor.measure import EstimationError
from salus.daemon.executor.results import call_error, error_text, is_iteration
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.wire.executor_ops import (
    Ack,
    Attach,
    CallDone,
    Checkpoint,
    Define,
    Estimate,
    Estimated,
    EstimateFailed,
    Failed,
    Load,
    Pull,
    Reply,
    Request,
    Restore,
    Run,
    Step,
)


def unsendable(exc: TypeError) -> dict[str, Any]:
    """The error reply for a result the wire cannot carry (it fails its call only)."""
    return call_error(TypeError(f"the call's result cannot be sent back: {exc}"))


def error_reply(exc: BaseException) -> dict[str, Any]:
    """The client's error reply for a request the executor refuses."""
    return {"ok": False, "code": "bad_request", "message": error_text(exc)}


def is_report(request: Any) -> bool:
    """Whether a request on a job's direct line asks the executor to report what ran now."""
    return type(request) is dict and request.get("op") == "report"


class Answered(NamedTuple):
    """What the daemon is told of a call that ran, apart from what the runtime still knows."""

    counted: bool  # one of the job's iterations
    seconds: float
    peak: int | None
    error: str | None  # the failed call's message; None when it succeeded


def run_call(runtime: JobRuntime, request: Any, forward: bool) -> tuple[CallDone, Any]:
    """Run the client's call `request`: (what the daemon is told, the client's reply).
    `forward`: the client's reply goes through the daemon (which keeps no copy of the call: it
    is never run again)."""
    reply, ran = answer_call(runtime, request)
    if runtime.retry:
        runtime.retry = False
        if ran.counted:
            runtime.iterations += 1
    return call_done(runtime, ran, forward), reply


def answer_call(runtime: JobRuntime, request: Any) -> tuple[Any, Answered]:
    """Run the client's call `request`: (the client's reply, what `call_done` needs)."""
    counted = is_iteration(request, runtime.kinds)
    if counted:
        runtime.iterations += 1
    reply, seconds, peak = runtime.run(request)
    if runtime.retry and counted:  # it runs again (`Executor._retry`): not an iteration yet
        runtime.iterations -= 1
    failed = isinstance(reply, dict) and reply.get("ok") is False
    return reply, Answered(counted, seconds, peak,
                           str(reply.get("message", ""))[:2000] if failed else None)


def call_done(runtime: JobRuntime, ran: Answered, forward: bool) -> CallDone:
    """What the daemon is told of the call `answer_call` ran last."""
    began, ended = runtime.last_span
    cache, comm = runtime.service_counters()
    return CallDone(ran.error is None, ran.seconds, ran.peak, ran.counted, began, ended,
                    ran.error, cache, comm, forward=forward, oom=runtime.last_oom is not None)


def estimate_call(runtime: JobRuntime, request: Any) -> Estimated | EstimateFailed:
    """The peak ephemeral bytes of `request` (None: a batch job's next batch) on fake
    tensors, or why they cannot be found."""
    try:
        peak, method = runtime.estimate(request)
        return Estimated(peak.bytes, method, reserved_bytes=peak.reserved_bytes)
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
    except Exception as exc:
        with_frame = isinstance(message, Attach | Define | Pull)
        return (Failed(error_text(exc)[:2000], forward=with_frame),
                error_reply(exc) if with_frame else None)
    return Failed(f"unknown executor op {message.op!r}"), None
