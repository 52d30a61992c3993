"""Dispatcher: the whole dispatch decision behind one narrow, typed interface.

The daemon's engine and the trace simulator both drive one `Dispatcher`: it owns the
`IterationScheduler` (admission, lanes, policy, job accounting), which lanes are busy, which
idle lanes are reserved for a gang, and which jobs have work waiting. Callers give it frozen
inputs and read frozen outputs; nothing outside `salus.scheduler` writes a scheduler object.

    apply(Ready | Finished | RanUnderLease | Forget) -> Update   what happened
    schedule() -> Iterator[Start]                                 what runs next

Gangs start all or nothing, by one rule for both drivers: when the policy picks a gang in one of
its lanes, all its lanes are reserved for it (none starts anything else); it starts once every
one of them is idle, on all of them at once. A reservation whose gang can no longer run (ended,
suspended, nothing to run) is dropped. Lanes are decided in (device, lane id) order, so the
outcome never depends on the order in which the caller learnt of events.

A lane may also be held outside a `Start` (`hold`): the daemon's leases, under which a job runs
its calls on its own and reports them afterwards (`RanUnderLease`).

On `movable` devices (the daemon's CPU devices, each only a budget) `rebalance` moves a job that
waits for a turn in a busy lane to a device where nothing runs or waits (`placement.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from salus.scheduler.dispatch_io import (
    NO_CHANGE,
    Finished,
    Forget,
    Input,
    JobView,
    LaneKey,
    LaneView,
    RanUnderLease,
    Ready,
    Start,
    Update,
    placed,
)
from salus.scheduler.iteration import IterationScheduler
from salus.scheduler.job import Job, JobState
from salus.scheduler.lanes import Placement
from salus.scheduler.mps import RunsAs, describe, runs_as
from salus.scheduler.placement import moves
from salus.scheduler.policies import Policy

_LIVE = (JobState.ADMITTED, JobState.RUNNING)
# the inputs and outputs, for callers that import them with the Dispatcher
__all__ = ["Dispatcher", "Finished", "Forget", "Input", "JobView", "LaneKey", "LaneView",
           "RanUnderLease", "Ready", "Start", "Update"]


@dataclass(slots=True)
class _Work:
    """What a job has waiting: its calls (True: an iteration), or for ever (`driven`). The
    queue of calls is made when the first one waits: a driven job (every simulated one) never
    needs it, and an empty deque takes 760 bytes, a million of them most of a large
    simulation's memory."""

    driven: bool = False
    open_ended: bool = False
    calls: deque[bool] | None = None

    def ready(self) -> bool:
        return self.driven or bool(self.calls)

    def wait(self, counted: bool) -> None:
        """One more call waits (`counted`: it is an iteration)."""
        if self.calls is None:
            self.calls = deque()
        self.calls.append(counted)

    def take(self) -> bool:
        """Start the next call: whether it is an iteration (a driven job's always is)."""
        if self.driven:
            return True
        if not self.calls:
            raise IndexError("no call waits")
        return self.calls.popleft()

    def drop(self) -> None:
        """Forget the calls that wait."""
        self.calls = None


class Dispatcher:
    """Admission, lanes, policy and dispatch of one node's devices (capacities in bytes)."""

    def __init__(self, capacities: Sequence[int], policy: Policy,
                 clock: Callable[[], float], *, measure: bool = True,
                 context_bytes: Sequence[int] | None = None,
                 movable: Iterable[int] = ()) -> None:
        self._sched = IterationScheduler(capacities, policy, clock, context_bytes)
        self._movable = frozenset(movable)  # devices a waiting job may move between
        self._measure = measure  # False: iteration times are declared (the simulator)
        self._busy: dict[LaneKey, int] = {}
        self._reserved: dict[LaneKey, int] = {}
        self._reserved_at: dict[int, LaneKey] = {}  # gang -> the lane that picked it
        self._work: dict[int, _Work] = {}
        #: counts changes of admission (jobs placed, moved, freed): a reader that reconciles
        #: memory with the lanes need do it only when this moved
        self.version = 0

    # ---- admission --------------------------------------------------------------------------
    def submit(self, job: Job, *, driven: bool = False, open_ended: bool = False) -> Update:
        """Admit `job` (ValueError if it can never fit). A `driven` job always has an iteration
        to run (the daemon drives a batch job's loop); an `open_ended` one ends when its caller
        says, not at `total_iterations` (which then only informs SRTF)."""
        made = self._sched.submit(job)
        self.version += 1
        self._work[job.job_id] = _Work(driven, open_ended)
        return placed(made)

    def requeue(self, job_id: int, persistent_bytes: int, ephemeral_bytes: int) -> Update:
        """Re-admit with corrected sizes (bytes); ValueError, nothing changed, if never fits."""
        made = self._sched.requeue(job_id, persistent_bytes, ephemeral_bytes)
        self.version += 1
        return Update(tuple(made))

    def suspend(self, job_id: int) -> None:
        if self._sched.jobs[job_id].state != JobState.SUSPENDED:
            self._sched.suspend(job_id)

    def resume(self, job_id: int) -> Update:
        self.version += 1
        return Update(tuple(self._sched.resume(job_id)))

    def swap_out(self, job_id: int) -> Update:
        self.version += 1
        return Update(tuple(self._sched.swap_out(job_id)))

    def set_priority(self, job_id: int, priority: float) -> None:
        self._sched.set_priority(job_id, priority)

    def serve_one_owner(self, devices: Iterable[int]) -> Update:
        """`devices` serve one owner at a time from now on (MPS GPUs: `mps.py`)."""
        self.version += 1
        return Update(tuple(self._sched.started(self._sched.lanes.serve_one_owner(devices))))

    def hold_owners(self, device: int, owners: Iterable[RunsAs]) -> Update:
        """`owners` have live processes on `device` now (its MPS clients): on a one-owner
        device no other owner's job is admitted while they do."""
        self.version += 1
        return Update(tuple(self._sched.started(self._sched.lanes.hold(device, owners))))

    def set_total(self, job_id: int, total_iterations: int) -> None:
        """An open-ended job now says how many iterations it plans (a script's framework
        knows its steps): SRTF reads them at the next decision."""
        job = self._sched.jobs[job_id]
        job.total_iterations = max(total_iterations, job.done_iterations)

    def set_policy(self, policy: Policy) -> Update:
        """Switch policy; call only when no lane is busy (lanes may be made anew)."""
        assert not self._busy, "the policy changes only when no call runs"
        self._reserved.clear()
        self._reserved_at.clear()
        self.version += 1
        return Update(tuple(self._sched.set_policy(policy)))

    def finish(self, job_id: int, state: JobState = JobState.FINISHED) -> Update:
        """End the job now (idempotent): its memory is freed, its waiting work dropped."""
        work = self._work.get(job_id)
        if work is not None:
            work.drop()
            work.driven = False
        for key in [k for k, j in self._reserved.items() if j == job_id]:
            del self._reserved[key]
        self._reserved_at.pop(job_id, None)
        self.version += 1
        return Update(tuple(self._sched.finish(job_id, state)))

    def withdraw(self, job_id: int) -> None:
        """The job's waiting calls were refused (its caller shuts down): none runs."""
        work = self._work.get(job_id)
        if work is not None:
            work.drop()

    # ---- inputs -----------------------------------------------------------------------------
    def apply(self, event: Input) -> Update:
        if isinstance(event, Ready):
            work = self._work.get(event.job_id)
            if work is not None and not self._sched.jobs[event.job_id].done:
                work.wait(event.counted)
            return NO_CHANGE
        if isinstance(event, Finished):
            for key in event.lanes:
                if self._busy.get(key) == event.job_id:
                    del self._busy[key]
            if event.first_began_s is not None:
                self._sched.iteration_started(event.job_id, at=event.first_began_s)
            return self._account(event.job_id, event.iterations, event.seconds, started=True)
        if isinstance(event, RanUnderLease):
            return self._account(event.job_id, event.iterations, event.seconds, started=False)
        self.version += 1
        self._sched.jobs.pop(event.job_id, None)
        self._work.pop(event.job_id, None)
        self._sched.swapped.discard(event.job_id)
        return NO_CHANGE

    def _account(self, job_id: int, iterations: int, seconds: float, *,
                 started: bool) -> Update:
        job = self._sched.jobs.get(job_id)
        if job is None:
            return NO_CHANGE
        if job.done:  # ran before it ended, reported after: counted, nothing to decide
            if iterations:
                job.record_iterations(iterations, seconds, measure=self._measure)
            return NO_CHANGE
        if not iterations:
            if job.state == JobState.RUNNING:
                job.state = JobState.ADMITTED
            return NO_CHANGE
        if not started:
            self._sched.iteration_started(job_id)
        if self._work[job_id].open_ended:
            job.total_iterations = max(job.total_iterations,
                                       job.done_iterations + iterations + 1)
        made = self._sched.iterations_done(job_id, iterations, seconds, measure=self._measure)
        if job.done:
            self.version += 1
        return placed(made)

    # ---- leases -----------------------------------------------------------------------------
    def hold(self, key: LaneKey, job_id: int) -> None:
        """Mark lane `key` busy with `job_id` outside a `Start` (a lease)."""
        assert key not in self._busy and key not in self._reserved, key
        self._busy[key] = job_id

    def release(self, key: LaneKey, job_id: int) -> None:
        """Lane `key` is no longer held by `job_id` (its lease ended, or its executor died)."""
        if self._busy.get(key) == job_id:
            del self._busy[key]

    # ---- moves ------------------------------------------------------------------------------
    def rebalance(self) -> Update:
        """Move each job waiting for a turn in a lane another job holds to a device where
        nothing runs or waits that fits it (movable devices only; `placement.moves`), at the
        boundary where it waits. Returns the moves and what the freed memory admitted."""
        held = {d for d, _ in (*self._busy, *self._reserved)} if self._movable else set()
        idle = [d for d in sorted(self._movable) if d not in held and not any(
            self._sched.jobs[j].state in _LIVE and self._ready(self._sched.jobs[j])
            for ln in self._sched.lanes.lanes(d) for j in ln.residents)]
        if not idle:
            return NO_CHANGE
        lanes = self._sched.lanes
        waiting = [job for job in self._sched.jobs.values() if self._waits(job)]
        made: list[Placement] = []
        moved: list[tuple[Placement, int]] = []
        for job_id, device in moves(waiting, idle, lanes.fits_on):
            if not lanes.fits_on(self._sched.jobs[job_id], device):
                continue  # a job admitted into what an earlier move freed took the room
            was = lanes.placements(job_id)[0].device
            made += self._sched.started(lanes.move(job_id, device))
            moved.append((lanes.placements(job_id)[0], was))
        self.version += bool(made)
        return Update(tuple(made), tuple(moved))

    def _waits(self, job: Job) -> bool:
        """Whether movable `job` waits on a movable device, in a lane another job holds."""
        placed = self._sched.lanes.placements(job.job_id)
        if (job.gang != 1 or job.exclusive or job.shares or job.state not in _LIVE
                or not placed or placed[0].device not in self._movable or not self._ready(job)):
            return False
        key = (placed[0].device, placed[0].lane_id)
        return self._busy.get(key, self._reserved.get(key, job.job_id)) != job.job_id

    # ---- decisions --------------------------------------------------------------------------
    def schedule(self, lanes: Iterable[LaneKey] | None = None) -> Iterator[Start]:
        """Start what the policy picks on every idle lane (or on `lanes` only; the others must
        be known to have nothing new), in (device, lane id) order. Each start is yielded as it
        is decided, before the next lane decides: consume the whole iterator."""
        keys = sorted(self._lane_keys() if lanes is None else lanes)
        for key in keys:
            if key in self._busy or self._sched.lanes.lane(*key) is None:
                continue
            holder = self._reserved.get(key)
            if holder is not None:
                started = self._start_gang(holder)
                if started is not None:
                    yield started
                if key in self._reserved or key in self._busy:
                    continue
            job = self._sched.pick(*key, ready=self._ready)
            if job is None:
                continue
            if job.gang > 1:
                started = self._reserve_gang(job.job_id, key)
                if started is not None:
                    yield started
                continue
            yield self._start(job.job_id, (key,))

    def lease_holder(self, key: LaneKey, unasked: Callable[[int], bool]) -> int | None:
        """The job that may run its calls in lane `key` without asking (a lease): the lane's
        only resident, or the head a non-preemptive policy keeps there whatever the others
        want (fifo runs it until it ends while they wait), if it is admitted or running and
        `unasked(job_id)` (the daemon's check: a direct channel, nothing queued through the
        daemon). None under a preemptive policy while others share the lane: one of them may
        be picked at the next boundary."""
        lane = self._sched.lanes.lane(*key)
        if lane is None or not lane.residents:
            return None
        chosen: int | None = lane.residents[0]
        if len(lane.residents) > 1:
            if self.policy.preemptive:
                return None
            pick = self._sched.next_iteration(*key)
            chosen = None if pick is None else pick.job_id
        if chosen is None or self._sched.jobs[chosen].state not in _LIVE or not unasked(chosen):
            return None
        return chosen

    def _ready(self, job: Job) -> bool:
        work = self._work.get(job.job_id)
        return work is not None and work.ready()

    def _start(self, job_id: int, lanes: tuple[LaneKey, ...]) -> Start:
        counted = self._work[job_id].take()
        for key in lanes:
            self._busy[key] = job_id
        if counted:
            self._sched.iteration_started(job_id)
        return Start(job_id, lanes, counted)

    def gang_lanes(self, job_id: int) -> tuple[LaneKey, ...]:
        """A job's lanes, one per replica in device order."""
        placed = sorted(self._sched.lanes.placements(job_id), key=lambda p: p.device)
        return tuple((p.device, p.lane_id) for p in placed)

    def _reserve_gang(self, job_id: int, picked_at: LaneKey) -> Start | None:
        """The policy picked gang `job_id` in lane `picked_at`: hold all its lanes (all or none,
        so two gangs never hold each other's) and start it once every one is idle."""
        lanes = self.gang_lanes(job_id)
        if any(self._reserved.get(k, job_id) != job_id for k in lanes):
            return None  # another gang holds one of them: asked again once that one ran
        if not any(self._reserved.get(k) == job_id for k in lanes):
            self._reserved_at[job_id] = picked_at
        for key in lanes:
            self._reserved[key] = job_id
        return self._start_gang(job_id)

    def _start_gang(self, job_id: int) -> Start | None:
        """Start gang `job_id` on all its lanes if all are idle; drop its reservations if it
        can no longer run."""
        job = self._sched.jobs.get(job_id)
        lanes = self.gang_lanes(job_id) if job is not None else ()
        held = {k for k, j in self._reserved.items() if j == job_id}
        if (job is None or not lanes or job.state not in _LIVE or not self._ready(job)
                or held != set(lanes)):
            for key in held:
                del self._reserved[key]
            self._reserved_at.pop(job_id, None)
            return None
        if any(k in self._busy for k in lanes):
            return None  # the last busy lane to finish starts it
        for key in lanes:
            del self._reserved[key]
        self._reserved_at.pop(job_id, None)
        return self._start(job_id, lanes)

    # ---- views ------------------------------------------------------------------------------
    @property
    def scheduler(self) -> IterationScheduler:
        """The scheduler itself, for the simulator's batching (in this package); it is read,
        never written, through this."""
        return self._sched

    def reservations(self) -> dict[LaneKey, LaneKey]:
        """Lanes held for a gang that waits for its other lanes, each with the lane whose pick
        reserved it."""
        if not self._reserved:
            return {}
        return {k: self._reserved_at[j] for k, j in self._reserved.items()}

    @property
    def policy(self) -> Policy:
        return self._sched.policy

    @property
    def busy(self) -> bool:
        """Whether any lane runs a call or is held."""
        return bool(self._busy)

    def busy_job(self, key: LaneKey) -> int | None:
        return self._busy.get(key)

    def running(self, job_id: int) -> bool:
        """Whether a call of `job_id` runs (or it holds a lane)."""
        return job_id in self._busy.values()

    def job(self, job_id: int) -> JobView | None:
        job = self._sched.jobs.get(job_id)
        if job is None:
            return None
        return JobView(job.job_id, job.state, job.done, job.done_iterations,
                       job.total_iterations, job.persistent_bytes, job.ephemeral_bytes,
                       job.iter_s, job.attained_s, job.submit_s, job.start_s, job.first_run_s,
                       job.finish_s, job.gang)

    def jobs(self) -> list[int]:
        return list(self._sched.jobs)

    def placements(self, job_id: int) -> tuple[Placement, ...]:
        return self._sched.lanes.placements(job_id)

    def lane(self, key: LaneKey) -> LaneView | None:
        lane = self._sched.lanes.lane(*key)
        if lane is None:
            return None
        return LaneView(lane.device, lane.lane_id, lane.size, tuple(lane.residents),
                        self._busy.get(key), self._reserved.get(key), lane.contexts)

    def lanes(self, device: int | None = None) -> list[LaneView]:
        views = (self.lane((ln.device, ln.lane_id)) for ln in self._sched.lanes.lanes(device))
        return [v for v in views if v is not None]

    def _lane_keys(self) -> list[LaneKey]:
        return [(ln.device, ln.lane_id) for ln in self._sched.lanes.lanes()]

    def pending(self) -> list[int]:
        """Jobs waiting for admission, in submit order."""
        return [j.job_id for j in self._sched.lanes.pending]

    def one_owner(self, device: int) -> str | None:
        """For status, on a device that serves one owner at a time: whom it serves and how many
        pending jobs of other owners wait (None: any owners share it)."""
        lanes = self._sched.lanes
        if device not in lanes.one_owner:
            return None
        serving = lanes.serving(device)
        waiting = sum(runs_as(j) not in serving for j in lanes.pending) if serving else 0
        return describe(serving, waiting)

    def persistent(self, device: int) -> int:
        """Bytes of persistent state placed on `device`, executors' contexts included."""
        return self._sched.lanes.persistent(device)

    def unreserved(self, device: int) -> int:
        return self._sched.lanes.unreserved(device)

    def check_invariants(self) -> None:
        self._sched.lanes.check_invariants()
        for key, job_id in self._reserved.items():
            assert key not in self._busy or self._busy[key] != job_id, (key, job_id)
