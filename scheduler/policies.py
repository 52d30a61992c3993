"""Iteration policies: at a lane's iteration boundary, which admitted job runs next.

A policy sees the lane's admitted, unfinished jobs and a readiness test (in the daemon an
interactive job is ready only once its client has sent the next batch; in the simulator every
job is always ready). Ties are broken by earlier submit time, then smaller job id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from salus.scheduler.job import Job, JobState
from salus.scheduler.lanes import LaneMode

Ready = Callable[[Job], bool]


def _runnable(jobs: Sequence[Job]) -> list[Job]:
    return [j for j in jobs if j.state in (JobState.ADMITTED, JobState.RUNNING)]


@dataclass(frozen=True)
class Policy:
    """A named rule with the lane mode it needs; `pick` returns None to leave the lane idle."""

    name: str
    lane_mode: LaneMode
    preemptive: bool
    description: str

    def pick(self, jobs: Sequence[Job], ready: Ready) -> Job | None:
        candidates = _runnable(jobs)
        if not candidates:
            return None
        if not self.preemptive:
            # Oldest job holds the lane until it finishes, even while its client is busy.
            head = min(candidates, key=lambda j: j.order_key)
            return head if ready(head) else None
        ready_jobs = [j for j in candidates if ready(j)]
        if not ready_jobs:
            return None
        return min(ready_jobs, key=self.rank)

    def rank(self, job: Job) -> tuple[float, float, int]:
        """Smaller runs first."""
        if self.name == "srtf":
            return (job.remaining_s, *job.order_key)
        if self.name == "fair":
            return (job.attained_s / job.priority, *job.order_key)
        return (0.0, *job.order_key)


POLICIES: dict[str, Policy] = {
    "fifo": Policy(
        "fifo",
        "single",
        False,
        "one lane per device; the oldest admitted job runs until it finishes (exclusive baseline)",
    ),
    "srtf": Policy(
        "srtf",
        "single",
        True,
        "one lane per device; smallest remaining time (iterations left x iteration time) first",
    ),
    "fair": Policy(
        "fair",
        "single",
        True,
        "one lane per device; least attained service (seconds run / priority) first",
    ),
    "pack": Policy(
        "pack",
        "pack",
        True,
        "lanes sized to each job's ephemeral peak run in parallel; oldest ready job per lane",
    ),
}


def make_policy(name: str) -> Policy:
    """The policy called `name` (fifo, srtf, fair, pack); ValueError names the choices."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
