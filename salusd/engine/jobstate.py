"""What state a job is in: decided here, for every reader.

Readers see a job two ways. The engine's views (`job.info()`, `salusd status`, REST) have the
live record and the scheduler's view of it: `live_state`. The event subscribers (Prometheus
metrics, the durable registry) see only the event stream: `EventState` follows one job through
it. Both speak one vocabulary:

- open: not yet submitted for admission (its state is loading, or its first call is sized);
- pending: waiting for admission (also after a swap-out or a re-admission), or for the jobs a
  script job runs after (`--after`);
- admitted / running: in a lane (`live_state` tells apart a job whose call runs now; the event
  stream does not, and says running for both);
- suspended: held by an operator or, restored after a restart, waiting for its client;
- finishing: a batch job that ran its iterations, while its final checkpoint is written (it is
  reported finished once that is on disk, so a reader of "finished" finds its final state);
- finished, cancelled, failed: ended, with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from salus.daemon.engine.registry import JobRecord
from salus.daemon.state.store import ENDED_STATES
from salus.scheduler.dispatch import JobView

ENDED = {"finish": "finished", "cancelled": "cancelled", "failed": "failed"}
"""The events that end a job, and the state each leaves it in (`ENDED_STATES`)."""
assert tuple(ENDED.values()) == ENDED_STATES
# `EventState.state` is one of LIVE_STATES.


def live_state(record: JobRecord, job: JobView | None) -> str:
    """The state of `record`, whose scheduler view is `job` (None before it is submitted)."""
    if not record.live:
        return record.life.end_state or "ended"
    if record.life.held or record.life.awaiting_client:
        return "suspended"
    if record.after:  # waiting for the jobs it runs after (--after)
        return "pending"
    if job is not None and job.done:
        return "finishing"
    if job is not None:
        return job.state.value
    return "open"


@dataclass
class EventState:
    """One job's state as the event stream tells it."""

    admission: str = "open"  # open, pending or running
    held: bool = False  # an operator suspended it

    @property
    def state(self) -> str:
        return "suspended" if self.held else self.admission

    def observe(self, kind: str) -> bool:
        """Follow event `kind` of this job; True when its state changed."""
        before = self.state
        if kind in ("submit", "requeue", "swap_out"):
            self.admission = "pending"
        elif kind == "admit":
            self.admission = "running"
        elif kind in ("suspend", "resume", "reattach"):
            self.held = kind == "suspend"
        return self.state != before
