"""One owner per MPS GPU (`salus.scheduler.mps`): legacy MPS runs one server per uid at a time,
so admission never places two owners' jobs on such a GPU at once, and keeps another owner's job
waiting while the GPU's live client processes are an owner's (a swapped-out job's process
outlives its admission). The rule alone, the lane manager under random operations, and the
engine with the shared fake executor."""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutors
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.engine.report import snapshot
from salus.daemon.wire.executor_ops import Attached, Place
from salus.daemon.wire.frames import json_frame
from salus.scheduler.job import Job
from salus.scheduler.lanes import LaneManager
from salus.scheduler.mps import admits, describe

MiB = 2**20


def _job(job_id: int, uid: int, p: int = 10 * MiB, e: int = 10 * MiB) -> Job:
    return Job(job_id, float(job_id), 10, p, e, owner=f"u{uid}", uid=uid)


def test_the_rule_admits_only_the_served_owner_or_anyone_on_an_idle_gpu() -> None:
    assert admits(set(), 1001)
    assert admits({1001}, 1001)
    assert not admits({1000}, 1001)
    assert not admits({1000, 1001}, 1001)
    assert describe({1001}, 2) == "mps: serving uid 1001; other owners wait (2 waiting)"
    assert describe(set(), 0).startswith("mps: serving no owner")


def test_another_owner_goes_to_another_gpu_then_waits_and_starts_when_the_first_leaves() -> None:
    lanes = LaneManager([100 * MiB, 100 * MiB], one_owner=[0, 1])
    assert [p.device for p in lanes.submit(_job(1, 1000))] == [0]
    assert [p.device for p in lanes.submit(_job(2, 1001))] == [1]  # not beside 1000's job
    assert lanes.submit(_job(3, 1002)) == []  # both GPUs serve someone: it waits
    assert [p.device for p in lanes.submit(_job(4, 1000))] == [0]  # 1000 joins its own GPU
    assert lanes.serving(0) == {1000} and lanes.serving(1) == {1001}
    assert lanes.release(2) != []  # GPU 1 is free: 1002's job goes there
    assert lanes.serving(1) == {1002}
    lanes.check_invariants()


def test_a_gpu_without_mps_takes_every_owner() -> None:
    lanes = LaneManager([100 * MiB, 100 * MiB], one_owner=[1])
    lanes.submit(_job(1, 1000))
    lanes.submit(_job(2, 1001))
    assert [p.device for p in lanes.submit(_job(3, 1002))] == [0]  # beside 1000, on GPU 0
    lanes.check_invariants()


def test_a_live_client_process_keeps_the_gpu_its_owners_after_its_jobs_leave() -> None:
    """1000's job was swapped out: its process still holds a context on the GPU, so 1001's job
    waits until the process is gone, though memory is free."""
    lanes = LaneManager([100 * MiB], one_owner=[0])
    lanes.submit(_job(1, 1000))
    assert lanes.hold(0, {1000}) == []
    assert lanes.submit(_job(2, 1001)) == []
    assert lanes.release(1) == []  # its admission ended, its process did not
    assert [p.job_id for p in lanes.hold(0, set())] == [2]
    assert lanes.serving(0) == {1001}
    lanes.check_invariants()


def test_a_gang_of_another_owner_takes_only_gpus_that_serve_no_one_else() -> None:
    lanes = LaneManager([100 * MiB] * 3, one_owner=[0, 1, 2])
    lanes.submit(_job(1, 1000))
    gang = Job(2, 2.0, 10, 10 * MiB, 10 * MiB, owner="u1001", uid=1001, gang=2)
    assert sorted(p.device for p in lanes.submit(gang)) == [1, 2]
    assert lanes.submit(Job(3, 3.0, 10, MiB, MiB, owner="u1002", uid=1002, gang=2)) == []
    lanes.check_invariants()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1000, 1002), st.integers(1, 60),
              st.integers(0, 60), st.integers(1, 2)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("hold"), st.integers(0, 2), st.sets(st.integers(1000, 1002), max_size=2)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, mode=st.sampled_from(["pack", "single"]))
def test_no_mps_gpu_ever_holds_two_owners_jobs_and_no_waiting_job_fits(
        ops: list[tuple], mode: str) -> None:
    lanes = LaneManager([100 * MiB, 80 * MiB, 120 * MiB], mode,  # type: ignore[arg-type]
                        one_owner=[0, 2], context_bytes=[MiB] * 3)
    live: list[int] = []
    uids: dict[int, int] = {}
    for op in ops:
        made = []
        if op[0] == "submit":
            _, uid, p, e, gang = op
            job = Job(len(uids), float(len(uids)), 10, p * MiB, e * MiB, owner=f"u{uid}",
                      uid=uid, gang=gang)
            uids[job.job_id] = uid
            try:
                made = lanes.submit(job)
            except ValueError:
                continue
            live.append(job.job_id)
        elif op[0] == "release" and live:
            made = lanes.release(live.pop(op[1] % len(live)))
        elif op[0] == "hold":
            made = lanes.hold(op[1], op[2])
        lanes.check_invariants()  # at most one owner's jobs per MPS GPU; no pending job fits
        for device in (0, 2):
            owners = {uids[j] for lane in lanes.lanes(device) for j in lane.residents}
            assert len(owners) <= 1, (device, owners)
        for placed in made:  # never beside another owner's live processes
            if placed.device in (0, 2):
                assert lanes.held.get(placed.device, frozenset()) <= {uids[placed.job_id]}


class _NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _opened(engine: Engine, port: FakeExecutors, uid: int) -> JobRecord:
    record = engine.open(Owner(f"u{uid}", uid, uid), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    port.answer(record.executor, Attached(64 * MiB, 1, forward=True), json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    return record


def test_the_engine_places_one_owners_jobs_on_an_mps_gpu_and_status_says_whom_it_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two owners, one MPS GPU with room for both: the second waits while the first's job and
    then its process are there, and is placed once the supervisor says the process is gone."""
    monkeypatch.setattr("salus.daemon.engine.registry.os.geteuid", lambda: 0)  # root: own uids
    port = FakeExecutors()
    engine = Engine([1024 * MiB], "pack", port, clock=lambda: 0.0, timers=_NoTimers(),
                    torch_devices=["cuda:0"], estimate_first=False)
    port.engine = engine
    engine.serve_one_owner([0])
    first = _opened(engine, port, 1000)
    assert any(isinstance(m, Place) for m in first.executor.sent)
    engine.mps_clients(0, {1000})  # its process became the GPU's client
    second = _opened(engine, port, 1001)
    assert engine.dispatch.pending() == [second.job_id]
    assert "mps: serving uid 1000; other owners wait (1 waiting)" in (
        snapshot(engine)["devices"][0]["sharing"])
    engine.cancel(first)
    assert engine.dispatch.pending() == [second.job_id]  # its process is still a client
    engine.mps_clients(0, set())
    assert engine.dispatch.pending() == []
    assert any(isinstance(m, Place) for m in second.executor.sent)
    assert "serving uid 1001" in snapshot(engine)["devices"][0]["sharing"]
    engine.check_invariants()
