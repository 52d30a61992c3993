"""First-call sizing through the real engine and the shared fake executor: a job admitted with
a guess gets a lane of what its first call measured, beyond the measurement's noise."""

from __future__ import annotations

from fake_executor import FakeExecutors

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.wire.executor_ops import Attached, CallDone, Estimated, Place, Placed, Run
from salus.daemon.wire.frames import json_frame

MiB = 2**20


class NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _measured_job(device: str, persistent: int) -> tuple[Engine, FakeExecutors, JobRecord]:
    port = FakeExecutors()
    engine = Engine([1024 * MiB], "pack", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=[device], estimate_first=False)
    port.engine = engine
    record = engine.open(Owner("u", 1000, 1000), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    port.answer(record.executor, Attached(persistent, 1, forward=True), json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    return engine, port, record


def _lane_bytes(engine: Engine, record: JobRecord) -> int:
    (placed,) = engine.dispatch.placements(record.job_id)
    return placed.lane_bytes


def _answer_call(port: FakeExecutors, record: JobRecord, peak: int) -> None:
    executor = record.executor
    while not isinstance(executor.unanswered[0][0], Run):
        port.answer(executor)  # the placement
    port.answer(executor, CallDone(True, 0.01, peak, True, 1.0, 1.01, forward=True))


def test_on_cuda_the_guess_is_the_state_and_the_lane_becomes_the_measured_peak() -> None:
    engine, port, record = _measured_job("cuda:0", 64 * MiB)
    assert _lane_bytes(engine, record) == 64 * MiB  # the guess: the state's size
    _answer_call(port, record, 3 * MiB)
    assert _lane_bytes(engine, record) == 3 * MiB
    places = [m for m in record.executor.sent if isinstance(m, Place)]
    assert places[-1].budget_bytes == 64 * MiB + 3 * MiB  # told its new budget
    engine.check_invariants()


def test_on_the_cpu_the_guess_is_small_and_noise_does_not_move_the_job() -> None:
    engine, port, record = _measured_job("cpu", 183 * MiB)
    assert _lane_bytes(engine, record) == 16 * MiB  # at most the noise allowance
    _answer_call(port, record, 3 * MiB)  # under the guess by less than the noise
    assert _lane_bytes(engine, record) == 16 * MiB
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    _answer_call(port, record, 40 * MiB)  # over the lane by more than the noise: moved
    assert _lane_bytes(engine, record) == 40 * MiB
    engine.check_invariants()


def test_a_call_out_of_device_memory_re_admits_its_job_with_twice_its_lane() -> None:
    engine, port, record = _measured_job("cuda:0", 64 * MiB)
    _answer_call(port, record, 8 * MiB)  # the first call sizes the lane: 8 MiB
    assert _lane_bytes(engine, record) == 8 * MiB
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    executor = record.executor
    while not isinstance(executor.unanswered[0][0], Run):
        port.answer(executor)
    # The cap was hit: the peak is a lower bound (the lane), and the call failed.
    port.answer(executor, CallDone(False, 0.01, 8 * MiB, True, None, None, "OutOfMemoryError",
                                   oom=True, forward=True))
    assert record.live, record.life.reason
    assert _lane_bytes(engine, record) == 16 * MiB
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.done_iterations == 1  # the failed call is no iteration
    engine.check_invariants()


def _estimated_job(device: str, workspace: int = 0) -> tuple[Engine, FakeExecutors, JobRecord]:
    """The mlp(1024) trainer of `tests/test_reserve.py`: 36 MiB of state exactly, 42 MiB
    reserved; its first call estimated at 5 MiB, 22 MiB reserved."""
    port = FakeExecutors()
    engine = Engine([1024 * MiB], "pack", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=[device], workspace_bytes=[workspace])
    port.engine = engine
    record = engine.open(Owner("u", 1000, 1000), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    port.answer(record.executor, Attached(36 * MiB, 1, forward=True,
                                          persistent_reserved_bytes=42 * MiB),
                json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    port.answer(record.executor, Estimated(5 * MiB, "fake-tensor", reserved_bytes=22 * MiB))
    return engine, port, record


def test_on_cuda_the_state_and_the_estimate_are_booked_in_reserved_bytes() -> None:
    engine, port, record = _estimated_job("cuda:0", workspace=34 * MiB)
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.persistent_bytes == 42 * MiB
    assert _lane_bytes(engine, record) == 22 * MiB
    assert engine.core.ledgers[0].size(("job", record.job_id)) == 42 * MiB
    while not record.executor.unanswered or not isinstance(
            record.executor.unanswered[0][0], Place):
        port.answer(record.executor)
    place = record.executor.unanswered[0][0]
    # The process's cap also holds its cuBLAS(Lt) workspaces (booked with its context), once
    # per process however many jobs it hosts: sent beside the job's budget.
    assert isinstance(place, Place) and place.budget_bytes == 42 * MiB + 22 * MiB
    assert place.workspace_bytes == 34 * MiB
    engine.check_invariants()


def test_on_the_cpu_the_exact_bytes_are_booked_and_reserved_ones_ignored() -> None:
    engine, _, record = _estimated_job("cpu")
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.persistent_bytes == 36 * MiB
    assert _lane_bytes(engine, record) == 5 * MiB
    engine.check_invariants()


def test_on_cuda_an_executor_that_sends_no_reserved_figure_is_booked_its_exact_bytes() -> None:
    port = FakeExecutors()
    engine = Engine([1024 * MiB], "pack", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=["cuda:0"])
    port.engine = engine
    record = engine.open(Owner("u", 1000, 1000), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    port.answer(record.executor, Attached(36 * MiB, 1, forward=True), json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    port.answer(record.executor, Estimated(5 * MiB, "fake-tensor"))
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.persistent_bytes == 36 * MiB
    assert _lane_bytes(engine, record) == 5 * MiB


def test_state_measured_on_the_gpu_above_its_booking_is_booked_as_measured() -> None:
    """After `place` the executor sends what the state really reserves on its GPU: more than
    the model booked re-admits the job with the measured bytes; less keeps the booking."""
    engine, port, record = _measured_job("cuda:0", 64 * MiB)
    executor = record.executor
    assert isinstance(executor.unanswered[0][0], Place)
    port.answer(executor, Placed(70 * MiB))
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.persistent_bytes == 70 * MiB
    assert engine.core.ledgers[0].size(("job", record.job_id)) == 70 * MiB
    while not isinstance(executor.unanswered[0][0], Place):
        port.answer(executor)
    port.answer(executor, Placed(60 * MiB))  # under the booking: kept
    job = engine.dispatch.job(record.job_id)
    assert job is not None and job.persistent_bytes == 70 * MiB
    engine.check_invariants()
