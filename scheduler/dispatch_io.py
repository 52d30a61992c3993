"""The `Dispatcher`'s inputs and outputs: what happened (`Ready`, `Finished`, `RanUnderLease`,
`Forget`), what it decided (`Start`, `Update`), and read-only views of its jobs and lanes. All
frozen: a caller cannot change the scheduler through them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from salus.scheduler.job import JobState
from salus.scheduler.lanes import Placement

LaneKey = tuple[int, int]


# ---- inputs ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """One more call of `job_id` waits to run; `counted` when it is an iteration."""

    job_id: int
    counted: bool = True


@dataclass(frozen=True, slots=True)
class Finished:
    """A started call of `job_id` returned on `lanes`: `iterations` of it counted (0 or 1; a
    simulator's batch may count many) in `seconds`. `first_began_s` backdates the job's first
    iteration (the simulator's merged fair segments)."""

    job_id: int
    lanes: tuple[LaneKey, ...]
    iterations: int
    seconds: float
    first_began_s: float | None = None


@dataclass(frozen=True, slots=True)
class RanUnderLease:
    """`iterations` of `job_id` ran in `seconds` under its lease, without a `Start`."""

    job_id: int
    iterations: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Forget:
    """`job_id` has ended and left the caller's registry: drop every trace of it."""

    job_id: int


Input = Ready | Finished | RanUnderLease | Forget


# ---- outputs --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    """Run the next call of `job_id` on `lanes` (one per replica, in device order) now;
    `counted` says whether the dispatcher counts it as an iteration."""

    job_id: int
    lanes: tuple[LaneKey, ...]
    counted: bool


@dataclass(frozen=True, slots=True)
class Update:
    """What an input or a command changed: the admissions it made (`moved`: of those, the
    jobs `rebalance` moved, each with the device it left)."""

    placed: tuple[Placement, ...] = ()
    moved: tuple[tuple[Placement, int], ...] = ()


NO_CHANGE = Update()  # frozen, so one instance serves every input that changed nothing


def placed(made: Sequence[Placement]) -> Update:
    """The update for admissions `made` (the shared empty one when none was made)."""
    return Update(tuple(made)) if made else NO_CHANGE


@dataclass(frozen=True)
class JobView:
    """A read-only copy of the scheduler's job (bytes, seconds)."""

    job_id: int
    state: JobState
    done: bool
    done_iterations: int
    total_iterations: int
    persistent_bytes: int
    ephemeral_bytes: int
    iteration_s: float | None
    attained_s: float
    submit_s: float
    start_s: float | None
    first_run_s: float | None
    finish_s: float | None
    gang: int


@dataclass(frozen=True)
class LaneView:
    """A read-only copy of a lane: its size (bytes), residents, who holds it, and the bytes
    booked for the executor processes it holds (`contexts`)."""

    device: int
    lane_id: int
    size: int
    residents: tuple[int, ...]
    busy_job: int | None
    reserved_for: int | None
    contexts: int = 0

    @property
    def key(self) -> LaneKey:
        return (self.device, self.lane_id)
