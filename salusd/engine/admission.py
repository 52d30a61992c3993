"""Admission: a job's first call sized (estimated on fake tensors, or measured), the job
submitted to the scheduler, and re-admitted when a call measures more than its lane holds."""

from __future__ import annotations

import logging
import signal

from salus.daemon.devices.discovery import format_size
from salus.daemon.engine import scripts
from salus.daemon.engine.booking import booked_estimate
from salus.daemon.engine.core import Core
from salus.daemon.engine.ledger import aligned
from salus.daemon.engine.ports import LaneKey
from salus.daemon.engine.registry import JobRecord, may_share_executor, requested_memory
from salus.daemon.wire.errors import BadRequest, DoesNotFit
from salus.daemon.wire.executor_ops import Estimated, EstimateFailed, Reply, failure
from salus.scheduler import Job
from salus.scheduler.dispatch import Ready

log = logging.getLogger("salusd.engine")
RSS_NOISE_BYTES = 16 * 2**20
"""On the CPU a call's peak is measured from the executor's resident set, which moves in pages
and includes the allocator's retained memory and torch's lazy start-up (a few MiB on the first
call); overshoots of a lane below this are noise, not growth."""


def estimated(core: Core, record: JobRecord, reply: Reply) -> None:
    """The first call's ephemeral size is known (`Estimated`; on a CUDA device its reserved
    bytes, `booking.booked_estimate`), or not (any other reply: the persistent size is the
    guess and the first call is measured): submit the job. A job that asked for its memory
    (`--mem`) is submitted with that instead."""
    if not record.live:
        return
    requested = requested_memory(record)
    if requested is not None:  # asked for (`--mem`): its lane, instead of an estimate
        ephemeral = requested
        record.estimate_method = "requested (--mem)"
    elif isinstance(reply, Estimated):
        ephemeral = booked_estimate(record.device_kind, reply)
        record.estimate_method = reply.method
    else:
        # No estimate: admit with a guess; the first real call is measured and the job's lane
        # is then made exactly what it measured (moved, or queued, if that is more).
        ephemeral = first_call_guess(record)
        record.ephemeral_guessed = True
        why = reply.reason if isinstance(reply, EstimateFailed) else failure(reply)
        record.estimate_method = f"first call measured (no fake-tensor estimate: {why[:300]})"
    record.estimate_bytes = ephemeral
    job = Job(job_id=record.job_id, submit_s=core.clock(),
              total_iterations=record.planned_iterations,
              persistent_bytes=aligned(record.persistent_bytes),
              ephemeral_bytes=aligned(ephemeral), owner=record.owner.name,
              name=record.name, priority=record.priority,
              done_iterations=record.progress.done_before, gang=record.gang,
              exclusive=record.nodes > 1, inference=record.inference, uid=record.owner.runs_as,
              shares=core.config.share_lanes and may_share_executor(record),
              devices=allowed_devices(core, record))
    refused = over_grant(core, record, job.persistent_bytes + job.ephemeral_bytes)
    if refused is not None:
        core.event("reject", record.job_id, reason=refused)
        core.end(record, "failed", str(DoesNotFit(refused)))
        return
    try:
        update = core.dispatch.submit(job, driven=record.kind == "batch",
                                      open_ended=record.kind == "interactive")
    except ValueError as exc:
        core.event("reject", record.job_id, reason=str(exc))
        needs = _needs(core, job.persistent_bytes, job.ephemeral_bytes)
        core.end(record, "failed", str(DoesNotFit(f"job {record.job_id} can never fit: "
                                                  f"{needs}")))
        return
    record.life.submitted()
    for call in record.calls:
        core.dispatch.apply(Ready(record.job_id, call.counted))
    if record.life.held:
        core.dispatch.suspend(record.job_id)
    core.event("submit", record.job_id, persistent=job.persistent_bytes,
               ephemeral=job.ephemeral_bytes, method=record.estimate_method)
    core.take(update)


def over_grant(core: Core, record: JobRecord, need_bytes: int) -> str | None:
    """Why a pod's job needing `need_bytes` (persistent plus lane, aligned) would take its
    pod's jobs past the pod's grant (`pod_grants.py`), or None."""
    if record.owner.allocation is None:
        return None
    booked = [(r, j.persistent_bytes + j.ephemeral_bytes) for r in core.registry.live.values()
              if (j := core.dispatch.job(r.job_id)) is not None]
    return core.pod_grants.refusal(record, need_bytes, booked)


def _needs(core: Core, persistent: int, ephemeral: int) -> str:
    """What a job that fits no device needs, and what the largest device has, for people."""
    largest = max(ledger.capacity for ledger in core.ledgers)
    return (f"it needs {format_size(persistent + ephemeral)} ({format_size(persistent)} of "
            f"state, {format_size(ephemeral)} per iteration), the largest device has "
            f"{format_size(largest)}")


def first_call_guess(record: JobRecord) -> int:
    """Bytes booked for a job's first call before it is measured: its persistent size, the
    usual order of a training step's peak. On the CPU at most `RSS_NOISE_BYTES`: memory there
    is accounted, not capped, so the guess need not hold the call, and a job whose state is
    most of the device must not be refused for twice its state (a 183 MiB model with
    momentum on a 256 MiB device was)."""
    if record.device_kind == "cpu":
        return min(record.persistent_bytes, RSS_NOISE_BYTES)
    return record.persistent_bytes


def allowed_devices(core: Core, record: JobRecord) -> frozenset[int] | None:
    """The devices `record` may be placed on: its pod allocation's GPU, and the GPUs its
    script's `CUDA_VISIBLE_DEVICES` names (`scripts.pinned_devices`); None: any."""
    allowed = None
    pod_device = core.pod_grants.device(record.owner.allocation)
    if pod_device is not None:
        allowed = frozenset({pod_device})
    if record.script is not None:
        try:
            pinned = scripts.pinned_devices(core, record.script.command)
        except BadRequest:  # restored on a node whose GPUs the pin no longer names
            pinned = frozenset()
        if pinned is not None:
            allowed = pinned if allowed is None else allowed & pinned
    return allowed


def measure_first(core: Core, record: JobRecord, what: str) -> None:
    """Admit a job without a fake-tensor estimate, with its persistent size as the guess;
    its first real `what` is measured (and re-admits it if it outgrows its lane). A gang
    job always: its replicas call collectives, which one replica run alone would issue
    without its peers. Any job where the daemon measures first calls (`estimate_first`
    False: CPU devices, whose memory is accounted, not enforced)."""
    reason = (f"a gang job is measured on its first {what}"
              if record.gang > 1 or record.nodes > 1 else
              f"this daemon measures a job's first {what} (--first-call measure)")
    estimated(core, record, EstimateFailed(reason))


def check_peak(core: Core, record: JobRecord, key: LaneKey, peak: int, *,
               oom: bool = False) -> None:
    """A call measured `peak` bytes above the job's resident state: a job over its lane
    is re-admitted with that size (moved to a lane that holds it, or queued), and so is a job
    alone in a lane sized by its first call's guess that the call needed less of. Both by more
    than the measurement's noise (on the CPU, `RSS_NOISE_BYTES`). A call that ran out of device
    memory (`oom`) measured only a lower bound: the job is re-admitted with twice its lane, or
    its peak if more. A job that asked for its memory (`--mem`) keeps its lane: on a GPU
    the cap holds it there, on the CPU it is ended (`over_request`) once it measures more."""
    record.measured_peak = max(record.measured_peak or 0, peak)
    lane = core.dispatch.lane(key)
    job = core.dispatch.job(record.job_id)
    if lane is None or job is None:
        return
    guessed, record.ephemeral_guessed = record.ephemeral_guessed, False
    slack = RSS_NOISE_BYTES if record.device_kind == "cpu" else 0
    requested = requested_memory(record)
    if requested is not None:  # its request is its cap: never grown
        if not oom and peak > requested + slack:
            over_request(core, record, peak, requested)
        return
    if oom:
        peak = max(peak, 2 * lane.size)
    elif guessed and lane.residents == (record.job_id,) and aligned(peak) + slack < lane.size:
        pass  # the lane was the first call's guess, more than the call needs: made its size
    elif peak <= lane.size + slack:
        return
    refused = over_grant(core, record, job.persistent_bytes + aligned(peak))
    if refused is not None:
        core.event("reject", record.job_id, reason=refused)
        core.end(record, "failed", str(DoesNotFit(refused)))
        return
    log.info("job %d measured %d B ephemeral in its %d B lane: re-admitting",
             record.job_id, peak, lane.size)
    try:
        update = core.dispatch.requeue(record.job_id, job.persistent_bytes, aligned(peak))
    except ValueError as exc:
        core.event("reject", record.job_id, reason=str(exc))
        core.end(record, "failed", str(DoesNotFit(
            f"job {record.job_id} measured {format_size(peak)} per call above its state, "
            f"more than any device can hold: {_needs(core, job.persistent_bytes, peak)}")))
        return
    core.event("requeue", record.job_id, *key, peak=peak)
    core.take(update)


def over_request(core: Core, record: JobRecord, peak: int, requested: int) -> None:
    """The job measured `peak` bytes in an iteration, more than the `requested` memory it
    asked for (`--mem`): as an out-of-memory kill under Slurm's `--mem`, the job fails and its
    process is killed at once (on the CPU nothing could cap it before)."""
    record.limit = "memory"
    record.signal, record.exit_status = signal.SIGKILL, 128 + signal.SIGKILL
    core.end(record, "failed", f"job {record.job_id} used {format_size(peak)} in an "
             f"iteration, more than the {format_size(requested)} it asked for (--mem)")
    core.outbox.kill_all(record)


def placed(core: Core, record: JobRecord, reserved: int) -> None:
    """The executor measured what moving the job's state onto its GPU made the process
    reserve (bytes). Where that is more than was booked (the allocator model errs high, so
    this is rare), the job is re-admitted with the measured persistent bytes: the ledger holds
    what the device does. A gang's replicas keep the booking (one figure books them all)."""
    job = core.dispatch.job(record.job_id)
    if job is None or record.gang > 1:
        return
    core.event("placed", record.job_id, reserved_bytes=reserved, booked=job.persistent_bytes)
    if aligned(reserved) <= job.persistent_bytes:
        return
    log.info("job %d reserves %d B of state on its GPU, %d B booked: re-admitting",
             record.job_id, reserved, job.persistent_bytes)
    record.persistent_bytes = aligned(reserved)
    try:
        update = core.dispatch.requeue(record.job_id, aligned(reserved), job.ephemeral_bytes)
    except ValueError:
        core.end(record, "failed", str(DoesNotFit(
            f"job {record.job_id} holds {format_size(reserved)} of state on its GPU, more "
            "than any device can hold beside its lane: "
            f"{_needs(core, reserved, job.ephemeral_bytes)}")))
        return
    core.take(update)


def check_memory(core: Core, mem_bytes: int | None) -> None:
    """BadRequest when no device of this node can hold `mem_bytes` (a `--mem` request)."""
    largest = max(ledger.capacity for ledger in core.ledgers)
    if mem_bytes is not None and mem_bytes > largest:
        raise BadRequest(f"the job needs {format_size(mem_bytes)} (--mem), the largest "
                         f"device has {format_size(largest)}")


def check_devices(core: Core, devices: object) -> int:
    """`devices` when this node has that many devices; BadRequest says what it has."""
    count = len(core.ledgers)
    if type(devices) is not int or not 1 <= devices <= count:
        raise BadRequest(f"this node has {count} device(s); a job may ask for 1 "
                         f"to {count}, not {devices!r}")
    return devices
