"""What comes back on a job's connection: a reply's result, or the error it stands for (the
daemon's, or the job's own exception rebuilt with its remote traceback as a note)."""

from __future__ import annotations

from typing import Any

from salus.daemon.wire import compact
from salus.daemon.wire.channel import FrameError, PickledPayload, reply_result
from salus.daemon.wire.errors import CallFailed


def json_result(reply: Any) -> Any:
    """A JSON reply's result; raises the error the reply stands for."""
    if type(reply) is compact.Message:
        raise FrameError(f"salusd answered with an unexpected compact frame {reply!r}")
    if isinstance(reply, dict) and reply.get("ok") is False and (
            reply.get("code") == CallFailed.code):
        raise _call_error(reply)
    return reply_result(reply)


def pickled_result(reply: Any) -> Any:
    """A reply's result, unpickled where it came pickled; raises as `json_result` does."""
    result = json_result(reply)
    return result.load("result") if isinstance(result, PickledPayload) else result


def _call_error(reply: dict[str, Any]) -> BaseException:
    """The job's own exception, re-raised here with its remote traceback as a note (or a
    CallFailed carrying its type, message and traceback when it cannot be rebuilt)."""
    text = str(reply.get("traceback", ""))
    exc_type, message = str(reply.get("type", "")), str(reply.get("message", ""))
    payload = reply.get("exception")
    exc: BaseException | None = None
    if isinstance(payload, PickledPayload):
        try:
            exc = payload.load("exception")
        except Exception:
            exc = None
    if not isinstance(exc, BaseException) or isinstance(exc, SystemExit | KeyboardInterrupt):
        exc = CallFailed(f"the job's code raised {message}", exc_type, text)
    exc.add_note(f"--- raised in salusd, in the job's code ---\n{text.rstrip()}")
    return exc
