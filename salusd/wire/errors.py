"""Errors a client can act on; the data plane and REST map them to codes, never to a crash."""

from __future__ import annotations


class SalusError(Exception):
    """Base class: `code` is a stable machine-readable name, the message says what to do."""

    code = "error"


class BadRequest(SalusError):
    """The request is malformed or inconsistent (wrong fields, wrong types, oversized)."""

    code = "bad_request"


class UnknownJob(SalusError):
    """No job with that id exists in this daemon (or it was already closed)."""

    code = "unknown_job"


class NotOwner(SalusError):
    """The caller does not own the job and holds no admin right."""

    code = "not_owner"


class Conflict(SalusError):
    """The job is in a state where the request cannot apply (e.g. resume a running job)."""

    code = "conflict"


class DoesNotFit(SalusError):
    """The job can never be admitted: it needs more memory than any device has."""

    code = "does_not_fit"


class JobFailed(SalusError):
    """The job ended without its owner asking: its executor died, or it outgrew every device.
    Later calls of the job get this error with the reason until the record expires."""

    code = "job_failed"


class CallFailed(SalusError):
    """The job's own code raised in one call; the job and its state stay as they were after the
    exception, exactly as in a loop that caught it. `exc_type` names the exception's class and
    `remote_traceback` holds the job's own traceback lines."""

    code = "call_failed"

    def __init__(self, message: str, exc_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


class ShuttingDown(SalusError):
    """salusd is stopping: queued calls are refused; running ones finish first."""

    code = "shutting_down"


class Busy(SalusError):
    """A bound was reached (connections, queued calls); try again later."""

    code = "busy"


class JobCancelled(SalusError):
    """The job was cancelled (by its owner, an admin, or daemon shutdown)."""

    code = "job_cancelled"


class StateDiskFull(SalusError):
    """salusd cannot record the request: the disk of its state dir is full. Nothing was
    started; the operator frees space and the same request then works."""

    code = "state_disk_full"


class DaemonUnavailable(SalusError, ConnectionError):
    """salusd cannot be reached, or the connection to it was lost."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[SalusError]] = {
    cls.code: cls
    for cls in (SalusError, BadRequest, UnknownJob, NotOwner, Conflict, DoesNotFit, JobFailed,
                CallFailed,
                JobCancelled, ShuttingDown, Busy, StateDiskFull, DaemonUnavailable)
}
