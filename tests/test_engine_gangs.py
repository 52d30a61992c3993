"""The engine's gang scheduling as a property: batch jobs of 1-3 replicas on 3 devices, under
every policy, with executors that answer in a random order (the shared fake executor,
`tests/fake_executor.py`, which records what the engine sends; the engine is pure policy on an
injected clock, so this is the real engine, only the processes are stood in for).

Checked after every engine step: a gang's iteration is sent to all its replicas at once or not
at all, each on its own lane and never beside another job's call in that lane; no call starts
in a lane held for a gang that waits for its other lanes; a replica is
placed on the device of its rank's lane; the ledgers match the scheduler. At the end every job
has run exactly its iterations, none waits for ever (no two gangs hold each other's lanes).

Some jobs span two nodes (this engine is node 0 of a cluster): under the pack policy each of
their lanes is theirs alone, so their iterations never wait behind another job's (on a real
cluster the other node's replicas wait for them in a collective); the other policies refuse
them, and refuse to switch to while one is live.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from fake_executor import FakeExecutor, FakeExecutors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from salus.daemon.cluster import ClusterSpec
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import Owner
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import Estimate, Request, Step
from salus.scheduler import POLICIES

DEVICES = 3
CAPACITY = 1 << 30
OWNER = Owner("alice", 1000, 1000)


class FakePort(FakeExecutors):
    """The shared fake executors, noting each step sent and checking that it starts in no lane
    held for another gang."""

    def __init__(self) -> None:
        super().__init__()
        self.steps_sent: list[tuple[int, FakeExecutor]] = []
        self.on_send = self._sent

    def _sent(self, executor: FakeExecutor, request: Request) -> None:
        if isinstance(request, Step):
            job_id = executor.record.job_id
            self.steps_sent.append((job_id, executor))
            assert self.engine is not None
            for key in self.engine.dispatch.gang_lanes(job_id):
                lane = self.engine.dispatch.lane(key)
                holder = lane.reserved_for if lane and lane.reserved_for is not None else job_id
                assert holder == job_id, f"job {job_id} started in {key}, held for gang {holder}"


class NoTimers:
    def call_later(self, delay_s: float, fn: Any) -> None:
        pass


def _answer(port: FakePort, ex: FakeExecutor) -> None:
    """Answer `ex`'s oldest message as an executor does (0.01 s steps, 512 KiB states)."""
    request = ex.unanswered[0][0]
    if isinstance(request, Estimate):  # one-replica jobs only: gangs are measured on their step
        assert ex.record.gang == 1
    port.answer(ex)


def _check_gang_calls(engine: Engine, port: FakePort) -> None:
    assert not port.killed, "no executor should be killed here"
    sent, port.steps_sent = port.steps_sent, []
    by_job: dict[int, set[int]] = {}
    for job_id, ex in sent:
        by_job.setdefault(job_id, set()).add(id(ex))
    for job_id, executors in by_job.items():
        record = engine.registry.live.get(job_id) or engine.registry.ended[job_id]
        assert executors == {id(e) for e in record.replicas}, (
            f"job {job_id}'s iteration went to {len(executors)} of its {record.gang} replicas")
        lanes = engine.dispatch.gang_lanes(job_id)
        assert len({d for d, _ in lanes}) == record.gang
        assert all(engine.dispatch.busy_job(k) == job_id for k in lanes)
        for rank, (device, _) in enumerate(lanes):
            assert record.replicas[rank].device == f"cpu:{device}", "replica on another device"
    for record in engine.registry.live.values():
        if record.spec.nodes > 1:
            for key in engine.dispatch.gang_lanes(record.job_id):
                lane = engine.dispatch.lane(key)
                assert lane is not None and lane.residents == (record.job_id,)
                assert lane.busy_job in (None, record.job_id)
                assert lane.reserved_for in (None, record.job_id)
    engine.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    jobs=st.lists(st.tuples(st.integers(1, DEVICES), st.integers(1, 6),
                            st.sampled_from([False, False, True])), min_size=1, max_size=7),
    seed=st.integers(0, 2**32 - 1),
    capacity=st.sampled_from([CAPACITY, 9 << 19]),  # 4.5 MiB of 512 KiB states: lanes shared
)
def test_gang_iterations_are_all_or_nothing_and_every_job_finishes(
        policy: str, jobs: list[tuple[int, int, bool]], seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    port = FakePort()
    now = [0.0]
    engine = Engine([capacity] * DEVICES, policy, port, clock=lambda: now[0], timers=NoTimers(),
                    torch_devices=[f"cpu:{d}" for d in range(DEVICES)],
                    cluster=ClusterSpec("127.0.0.1", 29500, nodes=2, node_rank=0))
    port.engine = engine
    if POLICIES[policy].lane_mode != "pack":
        with pytest.raises(BadRequest, match="pack"):
            engine.submit_batch(OWNER, "spanning", 1, "/jobs/s.py", "make", nodes=2)
        jobs = [(gang, iterations, False) for gang, iterations, _ in jobs]
    records = [engine.submit_batch(OWNER, f"job{i}", iterations, f"/jobs/j{i}.py", "make",
                                   devices=gang, nodes=2 if spanning else 1)
               for i, (gang, iterations, spanning) in enumerate(jobs)]
    if any(spanning for *_, spanning in jobs):
        with pytest.raises(BadRequest, match="lanes of their own"):
            engine.set_policy("fair")
    _check_gang_calls(engine, port)
    for _ in range(10_000):
        waiting = [ex for ex in port.executors if ex.unanswered]
        if not waiting:
            break
        ex = rng.choice(waiting)
        now[0] += 0.01
        _answer(port, ex)
        _check_gang_calls(engine, port)
    for record, (_, iterations, _) in zip(records, jobs, strict=True):
        assert record.life.end_state == "finished", (record.job_id, record.life)
        job = engine.dispatch.job(record.job_id)
        assert job is not None and job.done_iterations == iterations
        assert all(ex.iterations == iterations for ex in record.replicas)
    assert not engine.dispatch.busy and not engine.dispatch.reservations()


def test_no_job_joins_the_lanes_of_a_gang_spanning_nodes() -> None:
    """4.5 MiB devices and 512 KiB states: the fifth gang would share the oldest lane (the
    spanning gang's) if it could; it takes the next one instead."""
    port = FakePort()
    engine = Engine([9 << 19] * DEVICES, "pack", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=[f"cpu:{d}" for d in range(DEVICES)],
                    cluster=ClusterSpec("127.0.0.1", 29500, nodes=2, node_rank=0))
    port.engine = engine
    spanning = engine.submit_batch(OWNER, "spanning", 10, "/jobs/s.py", "make", devices=3,
                                   nodes=2)
    others = [engine.submit_batch(OWNER, f"g{i}", 10, "/jobs/g.py", "make", devices=3)
              for i in range(4)]
    for ex in list(port.executors):  # loads answered in submit order
        _answer(port, ex)
    lanes = engine.dispatch.gang_lanes(spanning.job_id)
    assert [_residents(engine, k) for k in lanes] == [(spanning.job_id,)] * 3
    shared = engine.dispatch.gang_lanes(others[-1].job_id)
    assert all(len(_residents(engine, k)) == 2 for k in shared)
    engine.check_invariants()


def _residents(engine: Engine, key: tuple[int, int]) -> tuple[int, ...]:
    lane = engine.dispatch.lane(key)
    assert lane is not None
    return lane.residents
