"""Admission: a job's first call sized (estimated on fake tensors, or measured), the job
submitted to the scheduler, and re-admitted when a call measures more than its lane holds."""

from __future__ import annotations

import logging
from typing import Any

from salus.daemon.engine.core import Core, LaneKey
from salus.daemon.engine.ledger import aligned
from salus.daemon.engine.registry import JobRecord
from salus.daemon.wire.errors import DoesNotFit
from salus.scheduler import Job
from salus.scheduler.dispatch import Ready

log = logging.getLogger("salusd.engine")
RSS_NOISE_BYTES = 16 * 2**20
"""On the CPU a call's peak is measured from the executor's resident set, which moves in pages
and includes the allocator's retained memory and torch's lazy start-up (a few MiB on the first
call); overshoots of a lane below this are noise, not growth."""


def estimated(core: Core, record: JobRecord, meta: dict[str, Any]) -> None:
    """The first call's ephemeral size is known (`meta["bytes"]`), or not (`ok` false: the
    persistent size is the guess and the first call is measured): submit the job."""
    if not record.live:
        return
    if meta.get("ok"):
        ephemeral = int(meta["bytes"])
        record.estimate_method = str(meta.get("method", "fake-tensor"))
    else:
        # Data-dependent code: admit with the persistent size as the guess; the first real
        # call is measured and the job is moved if it needs more.
        ephemeral = record.persistent_bytes
        record.estimate_method = ("first call measured (no fake-tensor estimate: "
                                  f"{str(meta.get('reason', ''))[:300]})")
    record.estimate_bytes = ephemeral
    job = Job(job_id=record.job_id, submit_s=core.clock(),
              total_iterations=record.planned_iterations,
              persistent_bytes=aligned(record.persistent_bytes),
              ephemeral_bytes=aligned(ephemeral), owner=record.owner.name,
              name=record.name, priority=record.priority,
              done_iterations=record.done_before, gang=record.gang,
              exclusive=record.nodes > 1)
    try:
        update = core.dispatch.submit(job, driven=record.kind == "batch",
                                      open_ended=record.kind == "interactive")
    except ValueError as exc:
        core.event("reject", record.job_id, reason=str(exc))
        core.end(record, "failed", str(DoesNotFit(f"job {record.job_id} can never fit: {exc}")))
        return
    record.phase = "submitted"
    for call in record.calls:
        core.dispatch.apply(Ready(record.job_id, call.counted))
    if record.held:
        core.dispatch.suspend(record.job_id)
    core.event("submit", record.job_id, persistent=job.persistent_bytes,
               ephemeral=job.ephemeral_bytes, method=record.estimate_method)
    core.take(update)


def measure_first(core: Core, record: JobRecord, what: str) -> None:
    """Admit a job without a fake-tensor estimate, with its persistent size as the guess;
    its first real `what` is measured (and re-admits it if it outgrows its lane). A gang
    job always: its replicas call collectives, which one replica run alone would issue
    without its peers. Any job where the daemon measures first calls (`estimate_first`
    False: CPU devices, whose memory is accounted, not enforced)."""
    reason = (f"a gang job is measured on its first {what}"
              if record.gang > 1 or record.nodes > 1 else
              f"this daemon measures a job's first {what} (--first-call measure)")
    estimated(core, record, {"ok": False, "reason": reason})


def check_peak(core: Core, record: JobRecord, key: LaneKey, peak: int) -> None:
    """A call measured `peak` bytes above the job's resident state: a job over its lane
    is re-admitted with that size (moved to a lane that holds it, or queued)."""
    record.measured_peak = max(record.measured_peak or 0, peak)
    lane = core.dispatch.lane(key)
    slack = RSS_NOISE_BYTES if record.device_kind == "cpu" else 0
    job = core.dispatch.job(record.job_id)
    if lane is None or job is None or peak <= lane.size + slack:
        return
    log.info("job %d measured %d B ephemeral, over its %d B lane: re-admitting",
             record.job_id, peak, lane.size)
    try:
        update = core.dispatch.requeue(record.job_id, job.persistent_bytes, aligned(peak))
    except ValueError as exc:
        core.event("reject", record.job_id, reason=str(exc))
        core.end(record, "failed", str(DoesNotFit(
            f"job {record.job_id} measured {peak} bytes per call above its state, more "
            f"than any device can hold: {exc}")))
        return
    core.event("requeue", record.job_id, *key, peak=peak)
    core.take(update)
