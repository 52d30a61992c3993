"""Moves of waiting jobs (`Dispatcher.rebalance`, `scheduler/placement.py`): on CPU devices a
job waiting in a busy lane moves to an idle device that fits it, never off or onto devices that
are not movable, never onto one too small or one where a job is ready to run."""

from __future__ import annotations

from salus.scheduler import Job, make_policy
from salus.scheduler.dispatch import Dispatcher, Finished, Ready


def _two_on_device_0(movable: tuple[int, ...], caps: tuple[int, int] = (100, 100)
                     ) -> Dispatcher:
    """Under fair (one lane a device): jobs 1 and 3 share device 0, job 2 had device 1 and
    ended; job 1 runs on device 0 and job 3 waits for its turn."""
    dispatch = Dispatcher(list(caps), make_policy("fair"), clock=lambda: 0.0,
                          movable=movable)
    sizes = {1: 10, 2: 10, 3: 30}  # job 3 fits no device of 25 bytes
    totals = {1: 5, 2: 1000, 3: 5}
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
