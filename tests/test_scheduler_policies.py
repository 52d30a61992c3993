"""The four policies, stepped one iteration at a time through IterationScheduler."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from salus.scheduler import IterationScheduler, Job, make_policy

job_specs = st.lists(
    st.tuples(
        st.integers(1, 12),  # iterations
        st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]),  # iteration seconds
        st.sampled_from([1.0, 1.0, 2.0, 3.0]),  # priority
        st.integers(0, 6),  # boundary at which the job arrives
    ),
    min_size=1,
    max_size=7,
)


class Stepper:
    """One device with ample memory; a virtual clock advanced by each iteration."""

    def __init__(self, policy: str) -> None:
        self.now = 0.0
        self.sched = IterationScheduler([1 << 30], make_policy(policy), clock=lambda: self.now)

    def add(self, jid: int, iterations: int, iter_s: float, priority: float = 1.0) -> None:
        self.sched.submit(Job(jid, self.now, iterations, 1, 1, est_iter_s=iter_s,
                              priority=priority))

    def lane(self) -> tuple[int, int]:
        lanes = self.sched.lanes.lanes(0)
        assert len(lanes) <= 1
        return (0, lanes[0].lane_id) if lanes else (0, -1)

    def live(self) -> list[Job]:
        return [j for j in self.sched.jobs.values() if not j.done]

    def step(self) -> Job | None:
        """Run the picked job's next iteration; None if the lane is idle."""
        decision = self.sched.next_iteration(*self.lane())
        if decision is None:
            return None
        job = self.sched.jobs[decision.job_id]
        self.sched.iteration_started(job.job_id)
        self.now += job.iteration_time
        self.sched.iteration_done(job.job_id, job.iteration_time, measure=False)
        return job


def _arrivals(specs: list[tuple[int, float, float, int]], boundary: int) -> list[int]:
    return [i for i, s in enumerate(specs) if s[3] == boundary]


@settings(max_examples=60, deadline=None)
@given(specs=job_specs)
def test_srtf_always_runs_the_smallest_remaining(
    specs: list[tuple[int, float, float, int]],
) -> None:
    st_ = Stepper("srtf")
    boundary = 0
    while boundary < 7 or st_.live():
        for i in _arrivals(specs, boundary):
            st_.add(i, specs[i][0], specs[i][1])
        live = st_.live()
        smallest = min((j.remaining_s for j in live), default=None)
        job = st_.step()
        if job is None:
            assert not live
        else:
            assert job.remaining_s + job.iteration_time == smallest
        boundary += 1


@settings(max_examples=60, deadline=None)
@given(specs=job_specs)
def test_fair_never_starves(specs: list[tuple[int, float, float, int]]) -> None:
    """A waiting job runs within the boundaries its rivals need to pass its attained/priority:
    rival i runs at most floor((v_j - v_i) * w_i / s_i) + 1 times before it is ahead of j."""
    st_ = Stepper("fair")
    boundary = 0
    waited: dict[int, int] = {}
    bound: dict[int, int] = {}

    def turns(rival: Job, waiting: Job) -> int:
        """Most iterations `rival` runs before its attained/priority passes `waiting`'s."""
        gap = waiting.attained_s / waiting.priority - rival.attained_s / rival.priority
        return math.floor(max(0.0, gap) * rival.priority / rival.iteration_time + 1e-9) + 1

    def set_bound(j: Job) -> None:
        bound[j.job_id] = sum(turns(i, j) for i in st_.live() if i is not j)
        waited[j.job_id] = 0

    while boundary < 7 or st_.live():
        for i in _arrivals(specs, boundary):
            st_.add(i, specs[i][0], specs[i][1], specs[i][2])
            new = st_.sched.jobs[i]
            set_bound(new)
            for other in st_.live():
                if other is not new:
                    bound[other.job_id] += turns(new, other)
        ran = st_.step()
        for j in st_.live():
            if ran is not None and j.job_id == ran.job_id:
                set_bound(j)
            else:
                waited[j.job_id] += 1
                assert waited[j.job_id] <= bound[j.job_id], f"job {j.job_id} starved"
        boundary += 1
    assert all(j.done for j in st_.sched.jobs.values())


@settings(max_examples=40, deadline=None)
@given(specs=job_specs)
def test_fair_shares_follow_priority(specs: list[tuple[int, float, float, int]]) -> None:
    """Whenever a job runs, its attained/priority was the least among the lane's jobs."""
    st_ = Stepper("fair")
    for i, (n, s, w, _) in enumerate(specs):
        st_.add(i, n, s, w)
    while st_.live():
        least = min((j.attained_s / j.priority, j.order_key) for j in st_.live())
        job = st_.step()
        assert job is not None
        assert ((job.attained_s - job.iteration_time) / job.priority, job.order_key) == least


def test_fifo_does_not_preempt_a_started_job() -> None:
    """An older job that becomes runnable later waits for the job holding the lane."""
    st_ = Stepper("fifo")
    st_.add(0, 3, 1.0)
    st_.sched.suspend(0)
    st_.add(1, 3, 1.0)
    assert st_.step().job_id == 1  # type: ignore[union-attr]
    st_.sched.resume(0)
    assert [st_.step().job_id for _ in range(2)] == [1, 1]  # type: ignore[union-attr]
    assert [st_.step().job_id for _ in range(3)] == [0, 0, 0]  # type: ignore[union-attr]


def test_pack_prefers_the_oldest_ready_job_in_a_lane() -> None:
    now = 0.0
    sched = IterationScheduler([100], make_policy("pack"), clock=lambda: now)
    # Persistent memory leaves room for one 40-byte lane only, so both share it.
    sched.submit(Job(0, 0.0, 5, 30, 40))
    sched.submit(Job(1, 1.0, 5, 30, 40))
    (p0,), (p1,) = sched.lanes.placements(0), sched.lanes.placements(1)
    assert p0.lane_id == p1.lane_id
    pick = sched.next_iteration(0, p0.lane_id, ready=lambda j: j.job_id != 0)
    assert pick is not None and pick.job_id == 1
    pick = sched.next_iteration(0, p0.lane_id)
    assert pick is not None and pick.job_id == 0


def test_only_fifo_keeps_a_lane_for_one_job_whatever_the_others_want() -> None:
    """`Dispatcher.lease_holder` names the job a lane's lease may go to: its only resident;
    where other jobs wait there, fifo's head, which every pick returns until it ends (its
    readiness aside), and no job under a preemptive policy, where a waiting job may be picked
    at the next boundary; never a job the caller says may not run unasked."""
    from salus.scheduler.dispatch import Dispatcher

    for name in ("fifo", "srtf", "fair", "pack"):
        dispatch = Dispatcher([100], make_policy(name), clock=lambda: 0.0)
        dispatch.submit(Job(0, 0.0, 5, 30, 40))
        (lane,) = dispatch.lanes()
        assert dispatch.lease_holder(lane.key, lambda _: True) == 0, name  # alone
        assert dispatch.lease_holder(lane.key, lambda _: False) is None, name
        dispatch.submit(Job(1, 1.0, 5, 30, 40))  # two 30+40-byte jobs: one shared lane
        (lane,) = dispatch.lanes()
        assert sorted(lane.residents) == [0, 1]
        pick = dispatch.scheduler.next_iteration(*lane.key)
        assert pick is not None
        want = pick.job_id if name == "fifo" else None
        assert dispatch.lease_holder(lane.key, lambda _: True) == want, name
        assert dispatch.lease_holder(lane.key, lambda j, w=want: j != w) is None, name
