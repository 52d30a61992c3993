"""What the engine does when a gang's replicas disagree: one raised, the others wait in a
collective it will never join, or returned with states that may now differ."""

from __future__ import annotations

from collections.abc import Callable

from salus.daemon.engine.core import Core, error_frame
from salus.daemon.engine.gang import GangReply
from salus.daemon.engine.ports import LaneKey, Sent
from salus.daemon.engine.registry import JobRecord
from salus.daemon.wire.errors import JobFailed
from salus.daemon.wire.executor_ops import Reply, StepDone, failure
from salus.daemon.wire.frames import RawFrame


def broke(core: Core, record: JobRecord, sent: Sent, reply: Reply) -> None:
    """A batch gang's replica raised in its iteration: its peers wait in a collective it will
    never join, so the job fails now and every replica is killed (their deaths free the
    lanes)."""
    iteration = reply.iteration if isinstance(reply, StepDone) else 0
    break_gang(core, record, f"iteration {iteration + 1} raised on replica {sent.replica}: "
               f"{failure(reply)[:2000]}", [sent.lane] if sent.lane else [])


def break_gang(core: Core, record: JobRecord, reason: str, lanes: list[LaneKey]) -> None:
    """Fail gang `record` with `reason` and kill every replica (peers may wait in a
    collective for ever); `lanes` are freed now, the others as their replicas die."""
    for lane in lanes:
        core.dispatch.release(lane, record.job_id)
    core.end(record, "failed", reason, executor_gone=True)
    core.outbox.kill_all(record)


def await_peers(core: Core, gang: GangReply, late: Callable[[], None]) -> None:
    """A replica's call of an interactive gang raised: its peers may wait for it in a
    collective. Give them `cancel_grace_s` seconds to answer (once per call); `late` runs
    if they do not."""
    if not gang.waiting:
        gang.waiting = True
        core.timers.call_later(core.config.cancel_grace_s, late)


def peers_late(core: Core, record: JobRecord, gang: GangReply) -> None:
    """Replicas of a failed gang call did not return in time (stuck in a collective its
    failed peer never joined): the call and the job fail, and every replica is killed."""
    if gang.complete or gang.abandoned or not record.live:
        return
    gang.abandoned = True
    missing = [r for r in range(gang.expected) if r not in gang.replies]
    reason = (f"{gang.raised()} and replica(s) {missing} did not return within "
              f"{core.config.cancel_grace_s:g} s (waiting in a collective for it?); the gang "
              "cannot go on")
    if gang.frame is not None:
        gang.frame.close_fd()
    if gang.head is not None and gang.head.answer is not None and 0 in gang.replies:
        gang.head.answer(error_frame(JobFailed(f"job {record.job_id} failed: {reason}")))
    break_gang(core, record, reason, gang.lanes)


def diverged(core: Core, record: JobRecord, gang: GangReply,
             frame: RawFrame | None) -> RawFrame:
    """A call raised on some replicas and returned on others: their states may differ now,
    so the job fails (after the call's accounting); returns the client's answer."""
    reason = (f"{gang.raised()} and returned on the others, so the replicas' states may "
              "differ; the gang cannot go on")
    if frame is not None:
        frame.close_fd()
    core.end(record, "failed", reason)
    return error_frame(JobFailed(f"job {record.job_id} failed: {reason}"))
