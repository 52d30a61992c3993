"""Lane admission: invariants under random operations, the incremental pending pass against a
full pass, requeue order, and the pending queue's search."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from salus.scheduler import IterationScheduler, Job, JobState, LaneManager, LaneMode, make_policy
from salus.scheduler.lanes import Placement
from salus.scheduler.pending import PendingQueue


class FullPassLaneManager(LaneManager):
    """Reference: after every change, one linear pass over the whole pending list."""

    def _admit(self, freed: Iterable[int], extra: int | None) -> list[Placement]:
        made: list[Placement] = []
        for job in list(self._pending):
            slots = self._find_slots(job)
            if slots is not None:
                self._pending.remove(job.job_id)
                made.extend(self._place(job, slots))
        return made


def _job(jid: int, submit: float, p: int, e: int, gang: int = 1, exclusive: bool = False,
         owner: str = "", shares: bool = False, inference: bool = False) -> Job:
    return Job(jid, submit, total_iterations=1, persistent_bytes=p, ephemeral_bytes=e, gang=gang,
               exclusive=exclusive, owner=owner, shares=shares and gang == 1,
               inference=inference)


def _snapshot(lm: LaneManager, ids: Iterable[int]) -> tuple[object, ...]:
    lanes = sorted((ln.device, ln.lane_id, ln.size, tuple(ln.residents)) for ln in lm.lanes())
    return (
        lanes,
        [j.job_id for j in lm.pending],
        {i: lm.placements(i) for i in ids},
        [lm.unreserved(d) for d in range(lm.num_devices)],
    )


class AdmissionMachine(RuleBasedStateMachine):
    """Random submits, releases and requeues on both the fast and the reference manager."""

    @initialize(
        mode=st.sampled_from(["pack", "single"]),
        caps=st.lists(st.integers(100, 1000), min_size=1, max_size=3),
        context=st.sampled_from([0, 0, 30]),
    )
    def setup(self, mode: LaneMode, caps: list[int], context: int) -> None:
        contexts = [context] * len(caps)  # each executor process a lane holds costs this
        self.fast = LaneManager(caps, mode, context_bytes=contexts)
        self.ref = FullPassLaneManager(caps, mode, context_bytes=contexts)
        self.known: list[int] = []
        self.clock = 0.0
        self.next_id = 0

    @rule(
        p=st.integers(0, 400),
        e=st.integers(0, 400),
        gang=st.integers(1, 3),
        earlier=st.booleans(),
        exclusive=st.sampled_from([False, False, True]),
        owner=st.sampled_from(["ada", "bo"]),
        shares=st.booleans(),
        inference=st.booleans(),
    )
    def submit(self, p: int, e: int, gang: int, earlier: bool, exclusive: bool, owner: str,
               shares: bool, inference: bool) -> None:
        gang = min(gang, self.fast.num_devices)
        # Mostly increasing submit times, sometimes an earlier one (a clock that went back).
        self.clock += 1.0
        submit = self.clock - 5.5 if earlier else self.clock
        jid = self.next_id
        self.next_id += 1
        a, b = (_job(jid, submit, p, e, gang, exclusive, owner, shares, inference),
                _job(jid, submit, p, e, gang, exclusive, owner, shares, inference))
        if not self.fast.can_ever_fit(a):
            with pytest.raises(ValueError, match="needs"):
                self.fast.submit(a)
            return
        assert self.fast.submit(a) == self.ref.submit(b)
        self.known.append(jid)

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        jid = data.draw(st.sampled_from(self.known))
        self.known.remove(jid)
        assert self.fast.release(jid) == self.ref.release(jid)

    @precondition(lambda self: self.known)
    @rule(data=st.data(), p=st.integers(0, 600), e=st.integers(0, 600))
    def requeue(self, data: st.DataObject, p: int, e: int) -> None:
        jid = data.draw(st.sampled_from(self.known))
        before = _snapshot(self.fast, self.known)
        try:
            made = self.fast.requeue(jid, p, e)
        except ValueError:
            assert _snapshot(self.fast, self.known) == before, "a failed requeue changed state"
            with pytest.raises(ValueError):
                self.ref.requeue(jid, p, e)
            return
        assert made == self.ref.requeue(jid, p, e)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "fast"):
            return
        self.fast.check_invariants()  # includes: no pending job fits now
        assert _snapshot(self.fast, self.known) == _snapshot(self.ref, self.known)


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_requeue_keeps_place_ahead_of_later_jobs() -> None:
    lm = LaneManager([100], "pack")
    a, b, c = _job(0, 0.0, 10, 40), _job(1, 1.0, 10, 40), _job(2, 2.0, 10, 40)
    lm.submit(a)
    lm.submit(b)
    lm.submit(c)
    assert [j.job_id for j in lm.pending] == [2]
    # `a` leaves its lane with new sizes: it is considered before `c`, which keeps waiting.
    made = lm.requeue(0, 20, 30)
    assert [p.job_id for p in made] == [0]
    assert [j.job_id for j in lm.pending] == [2]
    lm.check_invariants()


def test_failed_requeue_changes_nothing() -> None:
    sched = IterationScheduler([100], make_policy("fifo"), clock=lambda: 0.0)
    sched.submit(_job(0, 0.0, 10, 20))
    with pytest.raises(ValueError, match="needs 500 bytes"):
        sched.requeue(0, 300, 200)
    assert sched.lanes.placements(0) and sched.jobs[0].ephemeral_bytes == 20
    assert sched.cancel(0) == []
    sched.lanes.check_invariants()


def test_suspended_pending_job_stays_suspended_when_admitted() -> None:
    sched = IterationScheduler([100], make_policy("pack"), clock=lambda: 0.0)
    sched.submit(_job(0, 0.0, 0, 80))
    sched.submit(_job(1, 1.0, 0, 80))
    sched.suspend(1)
    sched.finish(0)
    assert sched.lanes.placements(1), "memory freed: the suspended job is admitted"
    assert sched.jobs[1].state == JobState.SUSPENDED
    assert sched.next_iteration(0, sched.lanes.placements(1)[0].lane_id) is None
    sched.resume(1)
    assert sched.jobs[1].state == JobState.ADMITTED


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "late", "remove"]),
                  st.integers(0, 50), st.integers(0, 50)),
        max_size=60,
    ),
    queries=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 60), st.integers(0, 100)),
                     min_size=1, max_size=10),
)
def test_pending_queue_matches_linear_scan(
    ops: list[tuple[str, int, int]], queries: list[tuple[int, int, int]]
) -> None:
    q = PendingQueue()
    model: list[Job] = []
    t = 0.0
    for i, (op, p, e) in enumerate(ops):
        if op == "remove":
            if model:
                victim = model.pop(p % len(model))
                assert q.remove(victim.job_id) is victim
            continue
        t += 1.0
        job = _job(i, t - 3.5 if op == "late" else t, p, e)
        q.insert(job)
        model.append(job)
        model.sort(key=lambda j: j.order_key)
    assert list(q) == model
    positions = [q.position(j.job_id) for j in model]
    assert positions == sorted(positions)
    for start, p_lim, need_lim in queries:
        pos = q.first_fitting(start, p_lim, need_lim)
        expect = next(
            (j for j, at in zip(model, positions, strict=True)
             if at >= start and j.persistent_bytes <= p_lim
             and j.persistent_bytes + j.ephemeral_bytes <= need_lim),
            None,
        )
        assert (q.at(pos) if pos is not None else None) is expect


def test_swap_out_frees_memory_and_resume_readmits_in_order() -> None:
    sched = IterationScheduler([100], make_policy("pack"), clock=lambda: 0.0)
    a, b = _job(1, 0.0, 40, 40), _job(2, 1.0, 40, 40)
    assert [p.job_id for p in sched.submit(a)] == [1]
    assert sched.submit(b) == []  # 80 + 80 > 100
    sched.suspend(1)
    with pytest.raises(ValueError):
        sched.swap_out(2)  # only a suspended job can be swapped out
    assert [p.job_id for p in sched.swap_out(1)] == [2]
    sched.lanes.check_invariants()
    assert sched.resume(1) == [] and a.state == JobState.PENDING  # waits for b's memory
    assert [p.job_id for p in sched.finish(2)] == [1]
    assert a.state == JobState.ADMITTED
    sched.suspend(1)
    sched.swap_out(1)
    assert sched.cancel(1) == [] and a.state == JobState.CANCELLED
    sched.lanes.check_invariants()


def test_an_exclusive_job_gets_lanes_of_its_own_and_nobody_joins_them() -> None:
    lm = LaneManager([100, 100], "pack")
    lm.submit(_job(0, 0.0, 10, 40))
    lm.submit(_job(1, 1.0, 10, 40))  # a new lane on device 1
    spanning = _job(2, 2.0, 10, 30, gang=2, exclusive=True)
    [a, b] = lm.submit(spanning)
    assert {a.device, b.device} == {0, 1}
    assert all(lm.lane(p.device, p.lane_id).residents == [2] for p in (a, b))
    # 10 B left per device: a small job would join a lane, but not the exclusive ones.
    assert lm.submit(_job(3, 3.0, 0, 30)) and lm.placements(3)[0].lane_id not in (
        a.lane_id, b.lane_id)
    # With no room for lanes of its own, an exclusive job waits rather than share.
    assert lm.submit(_job(4, 4.0, 0, 15, exclusive=True)) == []
    lm.check_invariants()


def test_a_job_that_shares_joins_its_owners_lane_where_a_new_executor_would_not_fit() -> None:
    """Pack mode, 100 B with 30 B per executor: ada's first job takes a new lane (10 + 20 +
    30); her second (10 P, 20 E) cannot open a lane (60 more > 40 free) and joins hers for its
    10 B of state alone; bo's job could join that lane only with an executor of its own (10 +
    30 > 30 free), so it waits until 10 B more are free."""
    lm = LaneManager([100], "pack", context_bytes=[30])
    first = lm.submit(_job(0, 0.0, 10, 20, owner="ada", shares=True))
    assert lm.unreserved(0) == 40 and first[0].lane_bytes == 20
    assert lm.submit(_job(1, 1.0, 10, 20, owner="ada", shares=True)) == [
        Placement(1, 0, first[0].lane_id, 20)]
    assert lm.unreserved(0) == 30  # no second executor booked
    assert lm.submit(_job(2, 2.0, 10, 20, owner="bo", shares=True)) == []
    lm.check_invariants()
    # Job 0's 10 B come back, ada's process stays for job 1: bo's job fits beside it now.
    assert lm.release(0) == [Placement(2, 0, first[0].lane_id, 20)]
    assert lm.unreserved(0) == 0
    lm.release(1)  # ada's last job there: her state and her executor are freed
    assert lm.unreserved(0) == 40
    lm.check_invariants()


def test_an_inference_job_joins_its_owners_lane_before_opening_one() -> None:
    lm = LaneManager([1000], "pack", context_bytes=[30])
    lane = lm.submit(_job(0, 0.0, 10, 50, owner="ada", shares=True, inference=True))[0]
    second = lm.submit(_job(1, 1.0, 10, 40, owner="ada", shares=True, inference=True))[0]
    assert second.lane_id == lane.lane_id  # room for a new lane, but it shares hers
    third = lm.submit(_job(2, 2.0, 10, 40, owner="ada", shares=True))[0]
    assert third.lane_id != lane.lane_id  # a training job still prefers a lane of its own
    bigger = lm.submit(_job(3, 3.0, 10, 80, owner="ada", shares=True, inference=True))[0]
    assert bigger.lane_id not in (lane.lane_id, third.lane_id)  # hers are too small for it
    lm.check_invariants()
    alone = lm.submit(_job(4, 4.0, 10, 40, 1, exclusive=True, owner="ada",
                           shares=True, inference=True))[0]
    assert alone.lane_id not in (lane.lane_id, third.lane_id, bigger.lane_id)  # exclusive
    lm.check_invariants()
