"""Script jobs that start once other jobs finished: `salusd run --after JOB` (REST `after`),
Slurm's `--dependency=afterok`.

Such a job gets its id at once and waits, in no lane and with no executor, until every job it
names has finished; then its command starts as any script job's does. When one of them fails
or is cancelled it can never start, and it fails naming that job and why (Slurm leaves such
a job pending for an operator; nobody watches a salusd job that way). A waiting job survives
a daemon restart: the durable registry keeps its command and environment, and it waits again,
its output then going to its log (its `salusd run` went away with the daemon).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from salus.daemon.engine.core import Core
from salus.daemon.engine.registry import JobRecord, Owner, parse_id
from salus.daemon.engine.script_command import ScriptCommand
from salus.daemon.limits import MAX_AFTER
from salus.daemon.wire.errors import BadRequest, NotOwner, UnknownJob
from salus.daemon.wire.frames import RawFrame

Outcome = tuple[str, str]  # how a job ended: (finished, cancelled or failed; the reason)


@dataclass(eq=False)
class Waiting:
    """A job waiting for `record.after`, the command it starts, and its client's sockets, one
    per rank (`frames`; None: its output goes to its log)."""

    record: JobRecord
    command: ScriptCommand
    frames: Sequence[RawFrame] | None


def check(core: Core, owner: Owner, after: object) -> tuple[int, ...]:
    """The job ids of a request's `after` (a list of 1 to MAX_AFTER ids of jobs `owner` may
    see); BadRequest, UnknownJob or NotOwner says what is wrong."""
    if (not isinstance(after, list | tuple) or not 1 <= len(after) <= MAX_AFTER
            or not all(type(a) in (int, str) for a in after)):
        raise BadRequest(f"'after' must be a list of 1 to {MAX_AFTER} job ids")
    ids = tuple(dict.fromkeys(parse_id(a) for a in after))
    for job_id in ids:
        _visible(core, owner, job_id)
    return ids


def _visible(core: Core, owner: Owner, job_id: int) -> None:
    try:
        core.registry.get(job_id, owner)
        return
    except UnknownJob:
        row = core.config.store.get_job(job_id) if core.config.store is not None else None
        if row is None:
            raise UnknownJob(f"--after {job_id}: there is no job {job_id}") from None
    if row.uid != owner.uid and not owner.is_admin:
        raise NotOwner(f"--after {job_id}: job {job_id} belongs to {row.owner}, not "
                       f"{owner.name}")


def outcome(core: Core, job_id: int) -> Outcome | None:
    """How job `job_id` ended; None while it is live."""
    if job_id in core.registry.live:
        return None
    record = core.registry.ended.get(job_id)
    if record is not None:
        return record.life.end_state or "failed", record.life.reason
    row = core.config.store.get_job(job_id) if core.config.store is not None else None
    if row is None:
        return "failed", "salusd no longer knows it"
    if row.state not in ("finished", "cancelled", "failed"):
        return None  # restored after this job, or being restored
    return row.state, row.reason


def settle(core: Core, waiting: dict[int, Waiting]) -> list[Waiting]:
    """The waiting jobs whose `after` jobs all finished, taken out of `waiting`; those one of
    which did not finish are failed (which may settle others: repeated until nothing changes),
    and those that ended while waiting (cancelled, their client gone) dropped."""
    ready: list[Waiting] = []
    changed = True
    while changed:
        changed = False
        for job_id, item in list(waiting.items()):
            record = item.record
            if record.live:
                _check(core, record)
            if record.live and record.after:
                continue
            del waiting[job_id]
            changed = True
            if record.live:
                ready.append(item)
            else:  # `salusd run` hears the end, and asks why
                for frame in item.frames or ():
                    frame.close_fd()
    return ready


def _check(core: Core, record: JobRecord) -> None:
    """Drop the finished jobs from `record.after`; fail `record` when one ended otherwise."""
    remaining = []
    for job_id in record.after:
        ended = outcome(core, job_id)
        if ended is None:
            remaining.append(job_id)
        elif ended[0] != "finished":
            state, reason = ended
            short = reason if len(reason) <= 500 else reason[:497] + "..."
            core.end(record, "failed", f"job {job_id}, which job {record.job_id} was to run "
                     f"after (--after), {state}: {short}")
            return
    record.after = tuple(remaining)


def waits_again(core: Core, record: JobRecord) -> bool:
    """Whether a restored script job was still waiting for its `--after` jobs: one of them
    has not finished (it starts the moment they all have, so one that has started finds
    them all finished). Then it waits again, for the ones still live (`record.after`)."""
    after = record.spec.after
    if all((ended := outcome(core, a)) is not None and ended[0] == "finished" for a in after):
        return False
    record.after = after
    return True
