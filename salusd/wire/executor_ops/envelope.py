"""Which job a message is for: an executor process hosts several jobs of one owner, so every
message between it and the daemon but `Become` and a process-wide `Exit` names its job.

The job id travels as the envelope key `"for_job"` beside the message's own fields: the supervisor
adds it to what the engine sends and takes it off what the executor answers, so the engine and
the message types never see it (`encode(decode_…(d)) == d` holds for the message itself).
"""

from __future__ import annotations

from salus.daemon.wire.executor_ops.requests import Wire

__all__ = ["address_of", "addressed"]

KEY = "for_job"


def addressed(meta: Wire, job: int) -> Wire:
    """`meta` (a message's wire dict) addressed to, or sent for, job `job`."""
    return {**meta, KEY: job}


def address_of(meta: Wire) -> int | None:
    """Take the job id off `meta` (in place) and return it; None when it names none, and
    ValueError when it names something that is not a job id."""
    job = meta.pop(KEY, None)
    if job is None or type(job) is int:
        return job
    raise ValueError(f"an executor message's 'for_job' is a job id (int), not {job!r}")
