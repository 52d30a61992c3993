"""IterationScheduler: admission plus a policy plus job accounting, behind one small interface.

The daemon's engine owns one instance and, at every iteration boundary of a lane, asks it which
job runs next; it calls it only from the daemon's one I/O thread, so the object takes no lock. The
simulator drives the very same object from its virtual clock. The clock is injected (seconds,
monotonic), so the object is deterministic under test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from salus.scheduler.job import Job, JobState
from salus.scheduler.lanes import LaneManager, Placement
from salus.scheduler.policies import Policy, Ready, always_ready


@dataclass(frozen=True)
class Decision:
    """Run one iteration of `job_id` in lane `lane_id` of `device`."""

    device: int
    lane_id: int
    job_id: int


class IterationScheduler:
    """Jobs, lanes and a policy for one node's devices (capacities in bytes)."""

    def __init__(
        self, capacities: Sequence[int], policy: Policy, clock: Callable[[], float],
        context_bytes: Sequence[int] | None = None,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.lanes = LaneManager(capacities, policy.lane_mode, context_bytes=context_bytes)
        self.jobs: dict[int, Job] = {}
        self.swapped: set[int] = set()

    def submit(self, job: Job) -> list[Placement]:
        """Add a job (ValueError if it can never fit); returns the placements made now."""
        if job.job_id in self.jobs:
            raise ValueError(f"job {job.job_id} already submitted")
        made = self.lanes.submit(job)
        self.jobs[job.job_id] = job
        self._mark_started(made)
        return made

    def lane_jobs(self, device: int, lane_id: int) -> list[Job]:
        lane = self.lanes.lane(device, lane_id)
        return [self.jobs[j] for j in lane.residents] if lane else []

    def next_iteration(
        self, device: int, lane_id: int, ready: Ready = always_ready
    ) -> Decision | None:
        """The policy's choice for this lane's next iteration, or None to stay idle."""
        job = self.pick(device, lane_id, ready)
        return Decision(device, lane_id, job.job_id) if job else None

    def pick(self, device: int, lane_id: int, ready: Ready = always_ready) -> Job | None:
        """The job the policy runs next in this lane, or None (`next_iteration`'s choice)."""
        return self.policy.pick(self.lane_jobs(device, lane_id), ready)

    def iteration_started(self, job_id: int, at: float | None = None) -> None:
        """The job's next iteration began (at `at` seconds, default now)."""
        job = self.jobs[job_id]
        if job.state == JobState.ADMITTED:
            job.state = JobState.RUNNING
        if job.first_run_s is None:
            job.first_run_s = self.clock() if at is None else at

    def iteration_done(
        self, job_id: int, seconds: float, *, measure: bool = True
    ) -> list[Placement]:
        """Account one iteration; a job that reached its total finishes and frees its lane.
        Returns the placements that freeing made."""
        return self.iterations_done(job_id, 1, seconds, measure=measure)

    def iterations_done(
        self, job_id: int, count: int, seconds: float, *, measure: bool = True
    ) -> list[Placement]:
        """Account `count` back-to-back iterations that took `seconds` in all (the simulator
        runs many at once); finishing and its placements as in `iteration_done`."""
        job = self.jobs[job_id]
        job.record_iterations(count, seconds, measure=measure)
        if job.state == JobState.RUNNING:
            job.state = JobState.ADMITTED
        if job.remaining_iterations == 0 and not job.done:
            return self.finish(job_id)
        return []

    def finish(self, job_id: int, state: JobState = JobState.FINISHED) -> list[Placement]:
        """End a job (finished or cancelled) and free its memory; idempotent."""
        job = self.jobs[job_id]
        if job.done:
            return []
        if job_id in self.swapped:  # holds no memory
            self.swapped.discard(job_id)
            made = []
        else:
            made = self.lanes.release(job_id)
        job.state = state
        job.finish_s = self.clock()
        self._mark_started(made)
        return made

    def cancel(self, job_id: int) -> list[Placement]:
        return self.finish(job_id, JobState.CANCELLED)

    def suspend(self, job_id: int) -> None:
        """Stop scheduling the job at the next boundary; it keeps its admission."""
        job = self.jobs[job_id]
        if job.done:
            raise ValueError(f"job {job_id} is {job.state.value}; it cannot be suspended")
        job.state = JobState.SUSPENDED

    def resume(self, job_id: int) -> list[Placement]:
        """Schedule a suspended job again; a swapped-out job asks for admission anew at its
        place in submit order. Returns the placements that made."""
        job = self.jobs[job_id]
        if job.state != JobState.SUSPENDED:
            raise ValueError(f"job {job_id} is {job.state.value}, not suspended")
        if job_id in self.swapped:
            self.swapped.discard(job_id)
            return self.started(self.lanes.submit(job))
        job.state = JobState.ADMITTED if self.lanes.placements(job_id) else JobState.PENDING
        return []

    def swap_out(self, job_id: int) -> list[Placement]:
        """Give a suspended job's memory back (its state goes to host memory); other jobs may be
        admitted into it. Returns the placements that made."""
        job = self.jobs[job_id]
        if job.state != JobState.SUSPENDED:
            raise ValueError(f"job {job_id} must be suspended before it is swapped out")
        if job_id in self.swapped:
            return []
        self.swapped.add(job_id)
        made = self.lanes.release(job_id)
        job.state = JobState.SUSPENDED
        return self.started(made)

    def set_policy(self, policy: Policy) -> list[Placement]:
        """Switch to `policy`. Between policies of one lane mode only the rule changes. Between
        lane modes (pack and the single-lane policies) every job that is admitted or waiting is
        admitted anew, in submit order, under the new mode: some may wait where they ran, none
        is lost. Call it when no iteration is running. Returns the placements made."""
        if policy.lane_mode == self.policy.lane_mode:
            self.policy = policy
            return []
        old = self.lanes
        self.policy = policy
        self.lanes = LaneManager([old.capacity(d) for d in range(old.num_devices)],
                                 policy.lane_mode, first_lane_id=old.next_lane_id,
                                 context_bytes=old.context_bytes, one_owner=old.one_owner)
        for device, owners in old.held.items():
            self.lanes.hold(device, owners)
        made: list[Placement] = []
        live = [j for j in self.jobs.values() if not j.done and j.job_id not in self.swapped]
        for job in sorted(live, key=lambda j: (j.submit_s, j.job_id)):
            was = job.state
            made += self.lanes.submit(job)
            if was == JobState.SUSPENDED:
                job.state = JobState.SUSPENDED
        return self.started(made)

    def set_priority(self, job_id: int, priority: float) -> None:
        if priority <= 0:
            raise ValueError(f"priority must be > 0, got {priority}")
        self.jobs[job_id].priority = priority

    def requeue(self, job_id: int, persistent_bytes: int, ephemeral_bytes: int) -> list[Placement]:
        """Re-admit a job with corrected sizes (bytes); it keeps its place in submit order.
        ValueError, with nothing changed, if the new sizes can never fit."""
        return self.started(self.lanes.requeue(job_id, persistent_bytes, ephemeral_bytes))

    def started(self, made: list[Placement]) -> list[Placement]:
        """Mark the jobs `made` placed (a lane command's placements); returns them."""
        self._mark_started(made)
        return made

    def _mark_started(self, made: list[Placement]) -> None:
        if not made:
            return
        now = self.clock()
        for p in made:
            job = self.jobs.get(p.job_id)
            if job is not None and job.start_s is None:
                job.start_s = now
