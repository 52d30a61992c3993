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


class DoesNotFit(SalusError):
    """The job can never be admitted: it needs more memory than any device has."""

    code = "does_not_fit"


class JobFailed(SalusError):
    """The job's own code raised while running an iteration; the job is stopped, others go on."""

    code = "job_failed"


class JobCancelled(SalusError):
    """The job was cancelled (by its owner, an admin, or daemon shutdown)."""

    code = "job_cancelled"


class DaemonUnavailable(SalusError, ConnectionError):
    """salusd cannot be reached, or the connection to it was lost."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[SalusError]] = {
    cls.code: cls
    for cls in (SalusError, BadRequest, UnknownJob, NotOwner, DoesNotFit, JobFailed, JobCancelled,
                DaemonUnavailable)
}
