"""The scheduler's view of a job: sizes, progress and timing, with no tensors attached."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class JobState(StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUSPENDED = "suspended"
    FINISHED = "finished"
    CANCELLED = "cancelled"


DONE_STATES = frozenset({JobState.FINISHED, JobState.CANCELLED})


@dataclass(slots=True)
class Job:
    """One training or inference job.

    Sizes are bytes, times are seconds. `est_iter_s` is the declared estimate of one iteration;
    `iter_s` the measured mean once the job has run (None before). `util` is the share of a
    device the job keeps busy when it runs alone (0-1]; `gang` the number of devices it needs at
    once (trace jobs asking for several GPUs); `exclusive` that it needs lanes of its own (a gang
    spanning nodes, whose iterations wait for peers another node schedules). `shares`: its
    executor process may host its owner's other sharing jobs of the same lane, so joining a
    lane where the owner already has one costs no new executor; `inference`: it serves a model
    and never trains, and joins its owner's lane rather than open a new one. `uid`: the uid its
    processes run as (None: its owner's name stands for it; see `mps.py`). `devices`: the only
    devices it may be placed on (a Kubernetes pod's job: its allocation's GPU; a script that
    set `CUDA_VISIBLE_DEVICES`: the GPUs it names; None: any). `start_s` is when
    admission placed it, `first_run_s` when its first iteration began, `finish_s` when it ended.
    """

    job_id: int
    submit_s: float
    total_iterations: int
    persistent_bytes: int
    ephemeral_bytes: int
    owner: str = ""
    name: str = ""
    est_iter_s: float = 1.0
    iter_s: float | None = None
    done_iterations: int = 0
    util: float = 1.0
    priority: float = 1.0
    gang: int = 1
    exclusive: bool = False
    shares: bool = False
    inference: bool = False
    uid: int | None = None
    devices: frozenset[int] | None = None
    state: JobState = JobState.PENDING
    attained_s: float = 0.0
    start_s: float | None = None
    first_run_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self) -> None:
        if self.total_iterations < 0:
            raise ValueError(f"job {self.job_id}: total_iterations must be >= 0")
        if self.persistent_bytes < 0 or self.ephemeral_bytes < 0:
            raise ValueError(f"job {self.job_id}: memory sizes must be >= 0 bytes")
        if not 0.0 < self.util <= 1.0:
            raise ValueError(f"job {self.job_id}: util must be in (0, 1], got {self.util}")
        if self.priority <= 0:
            raise ValueError(f"job {self.job_id}: priority must be > 0, got {self.priority}")
        if self.gang < 1:
            raise ValueError(f"job {self.job_id}: gang must be >= 1")

    @property
    def order_key(self) -> tuple[float, int]:
        """Tie-break order used everywhere: earlier submit time, then smaller id."""
        return (self.submit_s, self.job_id)

    @property
    def iteration_time(self) -> float:
        """Seconds per iteration: measured when known, else the declared estimate."""
        return self.iter_s if self.iter_s is not None else self.est_iter_s

    @property
    def remaining_iterations(self) -> int:
        return max(0, self.total_iterations - self.done_iterations)

    @property
    def remaining_s(self) -> float:
        return self.remaining_iterations * self.iteration_time

    @property
    def done(self) -> bool:
        return self.state in DONE_STATES

    @property
    def started(self) -> bool:
        """Whether the job has begun running iterations."""
        return self.first_run_s is not None or self.done_iterations > 0

    def record_iterations(self, count: int, seconds: float, *, measure: bool = True) -> None:
        """Count `count` finished iterations that took `seconds` in all; `measure` updates
        `iter_s` (the mean of measured iterations)."""
        if count < 1:
            raise ValueError(f"job {self.job_id}: count must be >= 1, got {count}")
        self.done_iterations += count
        self.attained_s += seconds
        if measure:
            self.iter_s = self.attained_s / self.done_iterations
