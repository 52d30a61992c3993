"""The engine's shared state, and the few operations every part of it needs: emit an event,
queue a client's call, end a job.

The parts (`admission`, `leases`, `gang_failures`, `checkpoints`, `step`) each take a `Core`; none
imports another part or the `Engine` facade, so there is no import circle. Changes to what the
scheduler admitted are collected in `placed` and acted on by the next `step`.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine.events import Event, EventStream
from salus.daemon.engine.ledger import DeviceLedger
from salus.daemon.engine.lifecycle import EndState
from salus.daemon.engine.outbox import Outbox
from salus.daemon.engine.pod_grants import PodGrants
from salus.daemon.engine.ports import CheckpointPolicy, DataCachePolicy, JobStore, Timers
from salus.daemon.engine.registry import Call, JobRecord, Registry
from salus.daemon.wire.errors import JobCancelled, JobFailed, SalusError, ShuttingDown
from salus.daemon.wire.frames import RawFrame, json_frame
from salus.scheduler import JobState, Placement, Policy
from salus.scheduler.dispatch import Dispatcher, Forget, Ready, Update

log = logging.getLogger("salusd.engine")


@dataclass(frozen=True)
class Config:
    """How the engine was started (see `Engine`)."""

    torch_devices: list[str]
    compute_slowdowns: list[float]
    threads: int = 1
    cancel_grace_s: float = 5.0
    max_queued_calls: int = 64
    estimate_first: bool = True
    checkpoints: CheckpointPolicy | None = None
    data_cache: DataCachePolicy | None = None
    cluster: ClusterSpec | None = None
    store: JobStore | None = None
    share_lanes: bool = False  # an owner's interactive jobs of one lane share an executor
    # per device: bytes an executor's cuBLAS(Lt) workspaces reserve beside its jobs (0: none)
    workspace_bytes: list[int] = field(default_factory=list)
    script_grace_s: float = 30.0  # a cancelled script's SIGTERM before its SIGKILL
    # per device: its GPU's UUID ("" for a CPU device), which a script's CUDA_VISIBLE_DEVICES
    # may name (`scripts.pinned_devices`)
    gpu_uuids: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Core:
    """What the engine's parts share. Only `salus.scheduler` writes the dispatcher's objects:
    the engine gives it inputs and reads views."""

    config: Config
    clock: Callable[[], float]
    timers: Timers
    outbox: Outbox
    dispatch: Dispatcher
    ledgers: list[DeviceLedger]
    registry: Registry
    events: EventStream
    stopping: bool = False
    pending_policy: Policy | None = None  # switched to once no call runs
    pod_grants: PodGrants = field(default_factory=PodGrants)  # Kubernetes pods' allocations
    placed: list[Placement] = field(default_factory=list)  # admissions the next step sends

    def event(self, kind: str, job_id: int, device: int = -1, lane_id: int = -1,
              **detail: Any) -> None:
        self.events.emit(Event(self.clock(), kind, job_id, device, lane_id, detail))

    def take(self, update: Update) -> None:
        """Keep what the scheduler admitted for the next step."""
        self.placed.extend(update.placed)

    def done_iterations(self, record: JobRecord) -> int:
        """Iterations the job has done, those done before the last restart included."""
        job = self.dispatch.job(record.job_id)
        return job.done_iterations if job is not None else record.progress.done_before

    def queue_call(self, record: JobRecord, call: Call) -> None:
        """A call waits for its turn; the dispatcher learns of it once the job is admitted."""
        record.calls.append(call)
        if record.life.phase == "submitted":
            self.dispatch.apply(Ready(record.job_id, call.counted))

    def refuse_queued(self, record: JobRecord) -> None:
        """Answer the job's queued calls: salusd is shutting down."""
        while record.calls:
            refuse(record.calls.popleft(), ShuttingDown("salusd is shutting down"))
        self.dispatch.withdraw(record.job_id)

    def end(self, record: JobRecord, state: EndState, reason: str, *,
            executor_gone: bool = False, grace: bool = False) -> None:
        """End a live job: answer its queued calls, free its memory now, and retire or kill its
        executor once its running call (if any) has returned. A script job that is cancelled,
        or ended with `grace` (its time limit), gets SIGTERM and its grace first (its own
        `grace_s`, else `script_grace_s`)."""
        error: SalusError = JobFailed(reason) if state == "failed" else JobCancelled(reason)
        while record.calls:
            refuse(record.calls.popleft(), error)
        job = self.dispatch.job(record.job_id)
        if job is not None and not job.done:
            self.take(self.dispatch.finish(record.job_id, JobState.FINISHED
                                           if state == "finished" else JobState.CANCELLED))
        done = self.done_iterations(record)
        self.registry.end(record, state, reason)
        for gone in [j for j in self.dispatch.jobs() if j not in self.registry.live
                     and j not in self.registry.ended]:
            self.dispatch.apply(Forget(gone))  # expired from the registry: forget it here too
        self.event(state if state != "finished" else "finish", record.job_id, reason=reason,
                   iterations_done=done, **exit_detail(record))
        log.info("job %d %s: %s", record.job_id, state, reason)
        if executor_gone:
            return
        if record.script is not None and (state == "cancelled" or grace):
            # As Kubernetes and Slurm end a job: SIGTERM, so that its handler may save a
            # checkpoint and exit (then `scripts.exited` lets it go), SIGKILL after the grace.
            # A gang's ranks that exited already are let go now (their clients hear their
            # statuses); a signal would run their handlers again.
            record.life.grace_begins()
            for rank, executor in enumerate(record.replicas):
                if rank not in record.script.exits:
                    self.outbox.signal(executor, signal.SIGTERM)
                else:
                    self.outbox.retire(executor, "job_failed" if state == "failed" else
                                       "job_cancelled", f"job {record.job_id} has {state}")
            own = record.script.command.grace_s
            self.timers.call_later(self.config.script_grace_s if own is None else own,
                                   lambda: self.outbox.kill_all(record))
            return
        if self.dispatch.running(record.job_id):
            record.life.cancelling()
            self.timers.call_later(self.config.cancel_grace_s,
                                   lambda: self.kill_if_running(record))
        else:
            self.finalize(record)

    def kill_if_running(self, record: JobRecord) -> None:
        if self.dispatch.running(record.job_id) and any(
                self.outbox.alive(executor) for executor in record.replicas):
            log.warning("job %d did not return within %.1f s of its end: killing its "
                        "executor(s)", record.job_id, self.config.cancel_grace_s)
            self.outbox.kill_all(record)

    def finalize(self, record: JobRecord) -> None:
        """Retire an ended job's executors once they answered what they were sent (a script in
        its grace is let go when its command ends, or killed after it: `end`)."""
        if record.life.grace:
            return
        code = "job_failed" if record.life.end_state == "failed" else "job_cancelled"
        self.outbox.retire_all(record, code, f"job {record.job_id} has {record.life.end_state}: "
                               f"{record.life.reason}")


def exit_detail(record: JobRecord) -> dict[str, Any]:
    """How a script job's command ended, for the events that say so (`end`'s kinds and
    `exit`): its exit status, the signal that ended it and the limit that ended the job."""
    return {"exit_status": record.exit_status, "signal": record.signal, "limit": record.limit}


def refuse(call: Call, error: SalusError) -> None:
    """Answer a queued call with `error` (a direct call is answered by its executor when it
    is told the job ended)."""
    if call.frame is not None:
        call.frame.close_fd()
    if call.answer is not None:
        call.answer(error_frame(error))


def error_frame(exc: SalusError) -> RawFrame:
    return json_frame({"ok": False, "code": exc.code, "message": str(exc)})


def ok_frame(result: object = None) -> RawFrame:
    return json_frame({"ok": True, "result": result})
