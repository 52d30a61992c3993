"""The simulator replays the daemon's own scheduling: the same random traces of gangs and
one-device jobs, run through the trace simulator and through the real `Engine` (a fake clock,
the shared fake executors, `tests/fake_executor.py`, answering each iteration after its trace
time), give the same schedule.

Both drive `scheduler/dispatch.py`; this test holds them to one rule for gangs (picked in one
lane, a gang reserves all its lanes and starts once all are idle), which they once disagreed on.

Policies: fifo, fair and pack. SRTF is left out by design: the simulator knows each job's
iteration time from the trace before it runs, the daemon only once it has run. Pack runs at
rate 1 here (utilisations sum below 1), since the daemon's fake executors model no
interference. Times sit on a 2**-10 s grid and are drawn so that no two events coincide: at one
instant the simulator applies every event before it decides, the daemon one reply at a time.
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any

import pytest
from fake_executor import FakeExecutor, FakeExecutors

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.wire.executor_ops import Request, Step
from salus.scheduler.sim import Simulator
from salus.scheduler.traces import TraceJob

OWNER = Owner("u", 1000, 1000)
UNIT = 2.0**-10
DEVICE_BYTES = 64 << 20


class Driver(FakeExecutors):
    """The engine's executors and clock: each message is answered in order, an iteration
    after its trace time (seconds), everything else at once."""

    def __init__(self, iter_s: dict[int, float], sizes: dict[int, tuple[int, int]]) -> None:
        super().__init__()
        self.iter_s = iter_s
        self.sizes = sizes  # job id -> (persistent, ephemeral) bytes
        self.now = 0.0
        self.due: dict[int, float] = {}  # id(executor) -> when its last queued reply is given
        self.heap: list[tuple[float, int, FakeExecutor]] = []
        self.starts: list[tuple[float, int]] = []
        self.seq = itertools.count()
        self.on_send = self._queue_reply

    def acquire(self, record: JobRecord, cwd: str | None, replica: int = 0) -> FakeExecutor:
        executor = super().acquire(record, cwd, replica)
        executor.persistent_bytes, executor.ephemeral_bytes = self.sizes[record.job_id]
        executor.seconds = self.iter_s[record.job_id]
        return executor

    def _queue_reply(self, executor: FakeExecutor, request: Request) -> None:
        delay = 0.0
        if isinstance(request, Step):
            if executor is executor.record.replicas[0]:
                self.starts.append((self.now, executor.record.job_id))
            delay = executor.seconds
        due = max(self.due.get(id(executor), 0.0), self.now) + delay
        self.due[id(executor)] = due
        heapq.heappush(self.heap, (due, next(self.seq), executor))

    def call_later(self, delay_s: float, fn: Any) -> None:
        raise AssertionError("no timer is needed in a trace")

    def clock(self) -> float:
        return self.now


def _trace(rng: random.Random, devices: int) -> list[TraceJob]:
    jobs = []
    submit = 0.0
    for job_id in range(1, rng.randint(3, 9) + 1):
        gang = devices if job_id == 1 else rng.choice([1, 1, 2, devices])
        persistent = rng.randint(1, 64) << 18
        ephemeral = persistent if gang > 1 else rng.randint(1, 64) << 18  # gangs: measured
        jobs.append(TraceJob(job_id, submit, rng.randint(1, 6), rng.randint(37, 997) * UNIT,
                             persistent, ephemeral, util=0.1, gang=gang))
        submit += rng.randint(1, 3000) * UNIT
    return jobs


def _through_engine(trace: list[TraceJob], policy: str, devices: int) -> tuple[Engine, Driver]:
    driver = Driver({j.job_id: j.iter_s for j in trace},
                    {j.job_id: (j.persistent_bytes, j.ephemeral_bytes) for j in trace})
    # The simulator models GPUs, where a waiting job never moves: the engine's CPU moves off.
    engine = Engine([DEVICE_BYTES] * devices, policy, driver, clock=driver.clock,
                    timers=driver, torch_devices=[f"cpu:{d}" for d in range(devices)],
                    move_waiting=False)
    driver.engine = engine
    arrivals = sorted(trace, key=lambda j: (j.submit_s, j.job_id))
    while arrivals or driver.heap:
        if arrivals and (not driver.heap or arrivals[0].submit_s < driver.heap[0][0]):
            job = arrivals.pop(0)
            driver.now = job.submit_s
            record = engine.submit_batch(OWNER, f"j{job.job_id}", job.iterations,
                                         f"/jobs/j{job.job_id}.py", "make", devices=job.gang)
            assert record.job_id == job.job_id
            continue
        due, _, executor = heapq.heappop(driver.heap)
        driver.now = due
        driver.answer(executor)
        engine.check_invariants()
        assert not driver.killed, "no executor is killed in a trace"
    return engine, driver


@pytest.mark.parametrize("policy", ["fifo", "fair", "pack"])
@pytest.mark.parametrize("seed", range(12))
def test_the_simulator_schedules_gangs_as_the_daemon_does(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    devices = rng.randint(2, 3)
    trace = _trace(rng, devices)
    sim = Simulator(trace, policy, devices=devices, device_memory_mb=DEVICE_BYTES / 2**20,
                    exact=True, record=True)
    result = sim.run()
    engine, driver = _through_engine(trace, policy, devices)
    sim_starts = sorted({(iv.start_s, iv.job_id) for iv in result.timeline})
    assert driver.starts == sim_starts
    for rec in result.records:
        job = engine.dispatch.job(rec.job_id)
        assert job is not None and job.done
        assert (job.start_s, job.first_run_s, job.finish_s) == (
            rec.admitted_s, rec.first_run_s, rec.finish_s), rec.job_id
