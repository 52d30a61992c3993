"""Checkpoints: when a job's state is written (every N iterations or seconds of its run time,
at suspend, at shutdown, at a batch job's end) and what the engine does with the answer."""

from __future__ import annotations

import logging
import os

from salus.daemon.engine.core import Core
from salus.daemon.engine.ports import OnDone
from salus.daemon.engine.registry import JobRecord
from salus.daemon.wire.errors import BadRequest, Conflict
from salus.daemon.wire.executor_ops import (
    Checkpoint,
    Checkpointed,
    Reply,
    StepDone,
    failure,
    succeeded,
)

log = logging.getLogger("salusd.engine")


def replica_dir(record: JobRecord, replica: int) -> str | None:
    """Where replica `replica` of the job keeps its checkpoints."""
    if record.checkpoint.dir is None or record.gang == 1:
        return record.checkpoint.dir
    return os.path.join(record.checkpoint.dir, f"replica{replica}")


def request(core: Core, record: JobRecord, on_done: OnDone | None = None) -> None:
    """Ask the job's executors to write its state at their next boundary; `on_done` gets the
    answer (iteration, bytes, seconds, path, or a message)."""
    if core.config.checkpoints is None:
        raise BadRequest("this salusd keeps no checkpoints (started without --state-dir)")
    if record.executor is None or record.life.phase in ("open", "estimating") or (
            record.life.phase == "attached" and record.kind == "batch"):
        raise Conflict(f"job {record.job_id} has no state to checkpoint yet")
    record.checkpoint.asking()
    core.outbox.send_all(record, [
        Checkpoint(replica_dir(record, r), record.job_id) for r in range(record.gang)],
        on_done=on_done)


def maybe(core: Core, record: JobRecord) -> None:
    """Checkpoint when the job ran the policy's iterations or seconds since its last one."""
    policy = core.config.checkpoints
    if policy is None or record.checkpoint.asked or not record.live or core.stopping:
        return
    if ((policy.every_iterations and record.checkpoint.since >= policy.every_iterations)
            or record.checkpoint.since_s >= policy.every_s):
        request(core, record)


def written(core: Core, record: JobRecord, reply: Reply) -> None:
    """The executors answered a checkpoint."""
    record.checkpoint.asked -= 1
    if not isinstance(reply, Checkpointed):
        log.warning("job %d: checkpoint failed: %s", record.job_id, failure(reply))
        return
    record.checkpoint.taken(reply.iteration, reply.time, reply.bytes)
    core.event("checkpoint", record.job_id, iteration=reply.iteration, seconds=reply.seconds,
               bytes=reply.bytes, path=reply.path, time=reply.time)


def batch_step_done(core: Core, record: JobRecord, reply: Reply) -> None:
    """After a batch job's iteration: fail it if its code raised, finish it (with a final
    checkpoint) when it ran all its iterations, else checkpoint when due."""
    if not isinstance(reply, StepDone) or not reply.ok:
        iteration = reply.iteration if isinstance(reply, StepDone) else 0
        core.end(record, "failed", f"iteration {iteration + 1} raised "
                 f"{failure(reply)[:2000]}")
        return
    record.progress.last_loss = reply.loss
    if reply.cache is not None:
        record.progress.cache = reply.cache
    if reply.evaluation is not None:
        record.progress.last_evaluation = reply.evaluation
    job = core.dispatch.job(record.job_id)
    if job is None or not job.done:
        maybe(core, record)
        return
    reason = f"ran its {job.done_iterations} iterations"
    if core.config.checkpoints is None:
        core.end(record, "finished", reason)
        return

    def finished(reply: Reply) -> None:
        if record.live:  # not ended meanwhile (cancelled, an executor died)
            core.end(record, "finished", reason if succeeded(reply) else (
                f"{reason}; its final checkpoint failed: {failure(reply)}"))

    # Reported finished once its final checkpoint is on disk (a done job is not picked again
    # meanwhile), so whoever reads "finished" finds the state it ended with.
    request(core, record, on_done=finished)
