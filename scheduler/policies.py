"""Iteration policies: at a lane's iteration boundary, which admitted job runs next.

A policy sees the lane's admitted, unfinished jobs and a readiness test (in the daemon an
interactive job is ready only once its client has sent the next batch; in the simulator every
job is always ready). Ties are broken by earlier submit time, then smaller job id.

A policy is one entry of `POLICIES`: its name, lane mode, whether it preempts, its rank (smaller
runs first) and its batching, which tells the simulator how long its pick stands without a
new event: "one" iteration (the default: a new policy is simulated exactly, one event per
iteration), "to_end" (the running job stays first until a job arrives or leaves: its rank does
not grow as it runs) or "fair" (least attained service: the lead lasts until a rival's
attained service would overtake, `fairshare.py`). The daemon, the simulator and the front ends
(`--policy`, REST) all take the policies from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from salus.scheduler.job import Job, JobState
from salus.scheduler.lanes import LaneMode

Ready = Callable[[Job], bool]
Rank = tuple[float, float, int]
Batching = Literal["one", "to_end", "fair"]
_LIVE = (JobState.ADMITTED, JobState.RUNNING)


def always_ready(job: Job) -> bool:
    return True


def runnable(jobs: Sequence[Job]) -> list[Job]:
    """The jobs a policy may pick: admitted and not suspended or ended."""
    return [j for j in jobs if j.state in _LIVE]


def _srtf_rank(job: Job) -> Rank:
    return (job.remaining_s, job.submit_s, job.job_id)


def _fair_rank(job: Job) -> Rank:
    return (job.attained_s / job.priority, job.submit_s, job.job_id)


def _hold_rank(job: Job) -> Rank:
    # Non-preemptive: a job that has begun keeps the lane; an older one admitted later waits.
    return (0.0 if job.started else 1.0, job.submit_s, job.job_id)


def _order_rank(job: Job) -> Rank:
    return (0.0, job.submit_s, job.job_id)


@dataclass(frozen=True)
class Policy:
    """A named rule with the lane mode it needs; `pick` returns None to leave the lane idle.
    `key` ranks a job (default: submission order; a non-preemptive policy keeps a job that
    has begun ahead of the rest); `batching` is the simulator's (module docstring)."""

    name: str
    lane_mode: LaneMode
    preemptive: bool
    description: str
    key: Callable[[Job], Rank] | None = None
    batching: Batching = "one"

    def pick(self, jobs: Sequence[Job], ready: Ready = always_ready) -> Job | None:
        if not self.preemptive:
            # The job holding the lane keeps it until it finishes, even while its client is busy.
            candidates = runnable(jobs)
            if not candidates:
                return None
            head = self._first(candidates)
            return head if ready(head) else None
        if ready is always_ready:
            candidates = runnable(jobs)
        else:
            candidates = [j for j in jobs if j.state in _LIVE and ready(j)]
        return self._first(candidates) if candidates else None

    def _first(self, jobs: list[Job]) -> Job:
        """The best-ranked of `jobs` (not empty); a lone job is ranked against no one."""
        return jobs[0] if len(jobs) == 1 else min(jobs, key=self.rank_function)

    def rank(self, job: Job) -> Rank:
        """Smaller runs first. Non-preemptive policies rank a job that has begun running ahead
        of any that has not: an older job admitted later never takes the lane from it."""
        return self.rank_function(job)

    @property
    def rank_function(self) -> Callable[[Job], Rank]:
        if self.key is not None:
            return self.key
        return _order_rank if self.preemptive else _hold_rank


POLICIES: dict[str, Policy] = {
    "fifo": Policy(
        "fifo",
        "single",
        False,
        "one lane per device; the oldest job runs until it finishes, no preemption (exclusive)",
        batching="to_end",
    ),
    "srtf": Policy(
        "srtf",
        "single",
        True,
        "one lane per device; smallest remaining time (iterations left x iteration time) first",
        key=_srtf_rank,
        batching="to_end",
    ),
    "fair": Policy(
        "fair",
        "single",
        True,
        "one lane per device; least attained service (seconds run / priority) first",
        key=_fair_rank,
        batching="fair",
    ),
    "pack": Policy(
        "pack",
        "pack",
        True,
        "lanes sized to each job's ephemeral peak run in parallel; oldest ready job per lane",
        batching="to_end",
    ),
}


DEFAULT_POLICY = "pack"  # what a daemon started without --policy runs (Salus's default)


def make_policy(name: str) -> Policy:
    """The policy called `name` (one of `POLICIES`); ValueError names the choices."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
