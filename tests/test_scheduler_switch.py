"""A live policy switch: every unfinished job is still known after it, admitted or waiting,
suspended jobs stay suspended, memory is never over-committed, and lane ids are never reused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from salus.scheduler import IterationScheduler, Job, JobState, make_policy

MiB = 2**20
jobs = st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50), st.booleans()),
                min_size=1, max_size=10)
policies = st.lists(st.sampled_from(["fifo", "srtf", "fair", "pack"]), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(specs=jobs, first=st.sampled_from(["fifo", "srtf", "fair", "pack"]), switches=policies,
       devices=st.integers(1, 3))
def test_switching_policies_loses_no_job(specs, first, switches, devices):
    sched = IterationScheduler([100 * MiB] * devices, make_policy(first), clock=lambda: 0.0)
    suspended = set()
    for jid, (persistent, ephemeral, suspend) in enumerate(specs, start=1):
        sched.submit(Job(jid, float(jid), 10, persistent * MiB, ephemeral * MiB))
        if suspend:
            sched.suspend(jid)
            suspended.add(jid)
    seen_lanes = {ln.lane_id for ln in sched.lanes.lanes()}
    for name in switches:
        sched.set_policy(make_policy(name))
        assert sched.policy.name == name
        sched.lanes.check_invariants()
        lanes = {ln.lane_id for ln in sched.lanes.lanes()}
        new = lanes - seen_lanes
        assert all(lane_id >= max(seen_lanes, default=-1) for lane_id in new)
        seen_lanes |= lanes
        placed = {j for ln in sched.lanes.lanes() for j in ln.residents}
        pending = {j.job_id for j in sched.lanes.pending}
        assert placed | pending == set(range(1, len(specs) + 1))
        assert not placed & pending
        for jid in suspended:
            assert sched.jobs[jid].state == JobState.SUSPENDED
        for jid in placed - suspended:
            assert sched.jobs[jid].state == JobState.ADMITTED
