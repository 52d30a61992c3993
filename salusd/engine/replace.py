"""A batch job whose executor ended with a poisoned CUDA context goes on from its last checkpoint.

A sticky CUDA error (an illegal address, a device-side assert) poisons the context of the
process that hit it: nothing more can run there, so the executor replies and ends, and the
supervisor reports its death as `poisoned`. Its jobs are not to blame for the other jobs of the
process, and a batch job whose state the daemon checkpointed can go on from that checkpoint in a
fresh executor, exactly as it would after a restart of salusd: its memory is freed, it is
forgotten by the dispatcher, and it is loaded, estimated and admitted anew (`setup.load` with
`restore`), its progress counted from the checkpoint.

Decided:
- Only single-replica batch jobs are placed again: an interactive job's state lives in its
  client's script as much as in the daemon, and a gang's peers wait in collectives of the dead
  replica's group; those fail with the reason, as before.
- A job is placed again at most `MAX_REPLACEMENTS` times: an error the job's own code causes
  (a device-side assert on bad labels) poisons every context it runs in, and the job then fails
  with the reason instead of looping.
"""

from __future__ import annotations

import logging

from salus.daemon.engine.core import Core
from salus.daemon.engine.registry import JobRecord
from salus.daemon.engine.setup import load
from salus.scheduler import JobState
from salus.scheduler.dispatch import Forget

log = logging.getLogger("salusd.engine")

MAX_REPLACEMENTS = 3


def may_replace(core: Core, record: JobRecord) -> bool:
    """Whether the live job, whose executor just ended poisoned, goes on from its checkpoint."""
    return (record.live and record.kind == "batch" and record.gang == 1 and record.nodes == 1
            and record.checkpoint.iteration is not None and record.checkpoint.dir is not None
            and not core.stopping and not record.life.cancel_requested
            and record.progress.replacements < MAX_REPLACEMENTS)


def again(core: Core, record: JobRecord, reason: str) -> None:
    """Free what the job held, forget it in the dispatcher and load its checkpoint in a fresh
    executor (the caller has answered what the dead executor owed)."""
    lost = core.done_iterations(record) - (record.checkpoint.iteration or 0)
    core.take(core.dispatch.finish(record.job_id, JobState.CANCELLED))
    core.dispatch.apply(Forget(record.job_id))
    record.progress.replacements += 1
    record.calls.clear()  # the daemon's own iteration requests: nobody waits on them
    record.replicas = []
    record.life.reopened()  # not swapped any more either
    record.persistent_bytes = 0
    record.estimate_bytes, record.estimate_method = None, ""
    record.ephemeral_guessed, record.measured_peak = False, None
    record.checkpoint.from_last()
    record.progress.resumed_from = record.progress.done_before = record.checkpoint.iteration or 0
    log.warning("job %d goes on from its checkpoint at iteration %d in a fresh executor "
                "(%d iteration(s) since then are run again): %s", record.job_id,
                record.progress.resumed_from, lost, reason)
    core.event("replaced", record.job_id, reason=reason, resumed_from=record.progress.resumed_from,
               replacements=record.progress.replacements)
    load(core, record, restore=True)
