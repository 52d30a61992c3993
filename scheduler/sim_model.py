"""The simulator's job model: the trace's jobs on its time grid, the batches of iterations it has in
flight, and what it reports per job.

`Run` is one job's batch of back-to-back iterations on all its lanes, progressing at a rate
that the engine (`sim.py`) sets from the interference on its devices; `Segment` is a whole
`fair` interleaving on one lane (`fairshare.plan`). Both carry a `version`, bumped whenever
their planned end moves, so an end event pushed earlier is recognised as stale. `prepare` puts
a trace on the grid the engine's exactness rests on (see the module docstring of `sim.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from salus.scheduler import fairshare
from salus.scheduler.job import Job
from salus.scheduler.traces import TraceJob

LaneKey = tuple[int, int]
GRID_S = 2.0**-20


class JobRecord(NamedTuple):
    """Outcome of one job (seconds of virtual time). A named tuple, not a frozen dataclass: a run
    makes one a job, and a frozen dataclass, built with one `object.__setattr__` call a field,
    takes over three times as long (about 1 µs against 0.3 µs: 0.7 s of a million-job run)."""

    job_id: int
    submit_s: float
    admitted_s: float
    first_run_s: float
    finish_s: float
    solo_s: float
    iterations: int
    gang: int
    util: float

    @property
    def jct_s(self) -> float:
        """Job completion time: finish - submit."""
        return self.finish_s - self.submit_s

    @property
    def queue_s(self) -> float:
        """Wait before the first iteration: first run - submit."""
        return self.first_run_s - self.submit_s


@dataclass(frozen=True, slots=True)
class Interval:
    """`iterations` back-to-back iterations of a job in one lane (recorded with record=True)."""

    device: int
    lane_id: int
    job_id: int
    start_s: float
    end_s: float
    iterations: int


@dataclass
class SimResult:
    policy: str
    devices: int
    device_memory_bytes: int
    records: list[JobRecord]
    events: int
    shrunk_gangs: int
    timeline: list[Interval] = field(default_factory=list)


class Run:
    """One job's batch of back-to-back iterations on all its lanes; `left` is solo seconds of
    work still to do as of `since`, done at `rate`."""

    __slots__ = ("count", "devices", "job", "lanes", "left", "rate", "since", "start", "version")

    def __init__(self, job: Job, lanes: tuple[LaneKey, ...], count: int, now: float) -> None:
        self.job = job
        self.lanes = lanes
        self.devices = tuple([d for d, _ in lanes])
        self.count = count
        self.left = count * job.iteration_time
        self.rate = 0.0
        self.since = now
        self.start = now
        self.version = 0

    @property
    def end(self) -> float:
        return self.since + self.left / self.rate


class Segment:
    """`fair` on a lane of one-device jobs: their merged iterations up to a planned point."""

    __slots__ = ("counts", "end", "finisher", "jobs", "lane", "shares", "start", "version")

    def __init__(self, lane: LaneKey, jobs: list[Job], now: float) -> None:
        self.lane = lane
        self.jobs = jobs
        self.shares = [
            fairshare.Share(j.attained_s, j.priority, j.iteration_time, j.remaining_iterations,
                            j.order_key)
            for j in jobs
        ]
        planned = fairshare.plan(self.shares)
        self.counts = planned.counts
        self.finisher = jobs[planned.finisher]
        self.start = now
        self.end = now + planned.duration_s
        self.version = 0


def prepare(jobs: Sequence[TraceJob], devices: int) -> tuple[list[Job], int]:
    """The trace's jobs as the scheduler's `Job`s (as `TraceJob.to_job` makes them), in submit
    order with times on the grid; gangs wider than the node shrink to it (iteration time
    scaled by asked/devices). Returns the jobs and how many shrank."""
    out, shrunk = [], 0
    for j in jobs:
        iter_s = j.iter_s
        if j.gang > devices:
            iter_s *= j.gang / devices
            shrunk += 1
        out.append(Job(
            job_id=j.job_id,
            submit_s=round(j.submit_s / GRID_S) * GRID_S,
            total_iterations=j.iterations,
            persistent_bytes=j.persistent_bytes,
            ephemeral_bytes=j.ephemeral_bytes,
            name=j.model,
            est_iter_s=max(1, math.ceil(iter_s / GRID_S)) * GRID_S,
            util=j.util,
            priority=j.priority,
            gang=min(j.gang, devices),
        ))
    out.sort(key=attrgetter("submit_s", "job_id"))
    return out, shrunk
