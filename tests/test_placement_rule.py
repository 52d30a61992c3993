"""Placement by expected remaining work (`scheduler/placement.py`): admission never places a
job where it does not fit and picks the least loaded device that fits (property tests, loads
summed here from the jobs' own numbers); the trace simulator places by the same rule; and on
CPU devices a job waiting in a busy lane moves to an idle device (`Dispatcher.rebalance`),
never on others."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from salus.scheduler import Job, LaneManager, LaneMode, make_policy
from salus.scheduler.dispatch import Dispatcher, Finished, Ready
from salus.scheduler.placement import UNKNOWN_REMAINING_ITERATIONS, UNKNOWN_TOTAL
from salus.scheduler.sim import Simulator
from salus.scheduler.traces import TraceJob

MIB = 2**20


@dataclass(frozen=True)
class Spec:
    """A job as the test draws it: sizes (bytes), iterations planned and done, and seconds per
    iteration (multiples of 1/8, so that sums are exact)."""

    persistent: int
    ephemeral: int
    total: int  # UNKNOWN_TOTAL: not said
    done: int
    eighths: int  # seconds per iteration x 8

    def job(self, job_id: int) -> Job:
        return Job(job_id, float(job_id), total_iterations=self.total,
                   persistent_bytes=self.persistent, ephemeral_bytes=self.ephemeral,
                   done_iterations=min(self.done, self.total), est_iter_s=self.eighths / 8)

    def work_s(self) -> float:
        """Its expected remaining seconds, by the rule's definition, from its own numbers."""
        done = min(self.done, self.total)
        left = UNKNOWN_REMAINING_ITERATIONS if self.total == UNKNOWN_TOTAL else self.total - done
        return left * (self.eighths / 8 if done else 1.0)


specs = st.builds(Spec, st.integers(1, 100), st.integers(0, 100),  # fits any device alone
                  st.sampled_from([1, 5, 40, 1000, UNKNOWN_TOTAL]), st.integers(0, 30),
                  st.integers(1, 40))


@given(mode=st.sampled_from(["pack", "single"]),
       caps=st.lists(st.integers(200, 1000), min_size=2, max_size=4),
       jobs=st.lists(specs, min_size=1, max_size=12))
def test_a_new_job_goes_to_the_least_loaded_device_that_fits(
        mode: LaneMode, caps: list[int], jobs: list[Spec]) -> None:
    lm = LaneManager(caps, mode)
    where: dict[int, int] = {}  # job id -> device, as the test saw admission place it
    for job_id, spec in enumerate(jobs, 1):
        loads = [sum(jobs[j - 1].work_s() for j, d in where.items() if d == dev)
                 for dev in range(len(caps))]
        fits, new = zip(*(_fits(lm, mode, dev, spec) for dev in range(len(caps))),
                        strict=True)
        made = lm.submit(spec.job(job_id))
        lm.check_invariants()
        if not made:
            assert not any(fits), f"job {job_id} fits device {fits.index(True)} but waits"
            continue
        (placed,) = made  # only this job can have been admitted: nothing was freed
        assert placed.job_id == job_id
        where[job_id] = placed.device
        assert fits[placed.device], f"job {job_id} placed on device {placed.device}, no room"
        # Pack prefers a new lane anywhere to sharing one: the least loaded device that gives
        # one, else the least loaded with a lane to join; single mode: of all that fit.
        pool = [dev for dev in range(len(caps)) if fits[dev] and (mode == "single" or new[dev])]
        best = min(pool or [d for d in range(len(caps)) if fits[d]], key=lambda d: (loads[d], d))
        assert placed.device == best, (placed.device, best, loads, fits, new)


def _fits(lm: LaneManager, mode: LaneMode, device: int, spec: Spec) -> tuple[bool, bool]:
    """Whether `spec` fits `device` now, and whether in a new lane of its size: else (pack) in
    a lane at least its size with room for its state, or (single) in the one lane, grown to
    its size."""
    p, e = spec.persistent, spec.ephemeral
    lanes = lm.lanes(device)
    used = lm.persistent(device) + sum(ln.size for ln in lanes)
    if mode == "single":
        size = max([e, *(ln.size for ln in lanes)])
        return lm.persistent(device) + p + size <= lm.capacity(device), False
    new = used + p + e <= lm.capacity(device)
    return new or any(ln.size >= e and used + p <= lm.capacity(device) for ln in lanes), new


def test_the_simulator_places_by_remaining_work_not_by_job_count() -> None:
    """Job 1 (100 x 1 s) takes device 0, job 2 (40 x 0.5 s) device 1. At 10 s job 1 has 90 s
    left and job 2 10 s, so job 3 goes to device 1, though each device holds one job (by job
    count it would have gone to device 0)."""
    trace = [TraceJob(1, 0.0, 100, 1.0, MIB, MIB), TraceJob(2, 0.0, 40, 0.5, MIB, MIB),
             TraceJob(3, 10.0, 4, 1.0, MIB, MIB)]
    for exact in (True, False):
        result = Simulator(trace, "fair", devices=2, device_memory_mb=64, exact=exact,
                           record=True, check=True).run()
        devices = {job: {iv.device for iv in result.timeline if iv.job_id == job}
                   for job in (1, 2, 3)}
        assert devices == {1: {0}, 2: {1}, 3: {1}}, (exact, devices)


# ---- moves on CPU devices ------------------------------------------------------------------
def _two_on_device_0(movable: tuple[int, ...], caps: tuple[int, int] = (100, 100)
                     ) -> Dispatcher:
    """Under fair (one lane a device): jobs 1 and 3 share device 0, job 2 had device 1 and
    ended; job 1 runs on device 0 and job 3 waits for its turn."""
    dispatch = Dispatcher(list(caps), make_policy("fair"), clock=lambda: 0.0,
                          movable=movable)
    sizes = {1: 10, 2: 10, 3: 30}  # job 3 fits no device of 25 bytes
    totals = {1: 5, 2: 1000, 3: 5}  # job 2's planned work sends job 3 to device 0
    for job_id in (1, 2, 3):
        dispatch.submit(Job(job_id, float(job_id), totals[job_id], sizes[job_id], 10),
                        open_ended=True)
    assert [dispatch.placements(j)[0].device for j in (1, 2, 3)] == [0, 1, 0]
    dispatch.finish(2)
    for job_id in (1, 3):
        dispatch.apply(Ready(job_id))
    assert [(s.job_id, s.lanes[0][0]) for s in dispatch.schedule()] == [(1, 0)]
    return dispatch


def test_a_job_waiting_on_a_busy_cpu_device_moves_to_the_idle_one() -> None:
    dispatch = _two_on_device_0(movable=(0, 1))
    update = dispatch.rebalance()
    dispatch.check_invariants()
    assert [(p.job_id, p.device, was) for p, was in update.moved] == [(3, 1, 0)]
    assert [p.job_id for p in update.placed] == [3]
    assert dispatch.placements(3)[0].device == 1
    assert (dispatch.persistent(0), dispatch.persistent(1)) == (10, 30)  # booked there only
    assert [(s.job_id, s.lanes[0][0]) for s in dispatch.schedule()] == [(3, 1)]
    assert dispatch.rebalance().moved == ()  # nothing waits now
    dispatch.apply(Finished(1, ((0, dispatch.placements(1)[0].lane_id),), 1, 0.5))
    assert dispatch.rebalance().moved == ()  # device 0 idles, but no job waits for a turn


def test_no_job_moves_off_devices_that_are_not_movable_or_onto_one_too_small() -> None:
    for movable, caps in (((), (100, 100)), ((0,), (100, 100)), ((0, 1), (100, 25))):
        dispatch = _two_on_device_0(movable, caps)
        assert dispatch.rebalance().moved == (), (movable, caps)
        assert dispatch.placements(3)[0].device == 0


def test_a_device_with_a_job_ready_to_run_is_not_idle() -> None:
    dispatch = _two_on_device_0(movable=(0, 1))
    dispatch.submit(Job(4, 4.0, 5, 10, 10), open_ended=True)  # to device 1, the empty one
    assert dispatch.placements(4)[0].device == 1
    dispatch.apply(Ready(4))
    assert dispatch.rebalance().moved == ()
    assert dispatch.placements(3)[0].device == 0
