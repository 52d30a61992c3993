"""Every admitted job can be placed: the engine's admission (the Salus lane rule) books exactly
what the placement ledger needs, so no random mix of jobs, sizes, finishes, re-admissions and
swaps ever fails a placement. The engine runs for real; only its executors are replaced by the
shared fake executor (`tests/fake_executor.py`), which records what each was sent and answers
the way executors do (the executor processes are tested with the daemon).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fake_executor import FakeExecutors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from salus.daemon.engine import admission
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.ledger import ALIGNMENT, DeviceLedger, aligned
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.wire.executor_ops import Attached, Estimated, Place
from salus.daemon.wire.frames import json_frame

MiB = 2**20


class NoTimers:
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        pass


def _engine(capacities: list[int], policy: str) -> tuple[Engine, FakeExecutors]:
    executors = FakeExecutors()
    clock = iter(range(10**9))
    engine = Engine(capacities, policy, executors, clock=lambda: float(next(clock)),
                    timers=NoTimers(), torch_devices=["cpu"] * len(capacities))
    executors.engine = engine
    return engine, executors


def _grow(engine: Engine, record: JobRecord, key: tuple[int, int], peak: int) -> None:
    """A call of `record` measured `peak` bytes: what the engine does with a call's peak."""
    admission.check_peak(engine.core, record, key, peak)
    engine._step()


def _open_and_submit(engine: Engine, executors: FakeExecutors, persistent: int,
                     ephemeral: int) -> JobRecord:
    """What a client and its executor do up to admission: open, attach, first call, estimate."""
    record = engine.open(Owner("u", 1000, 1000), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    executors.answer(record.executor, Attached(persistent, 1, forward=True),
                     json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    executors.answer(record.executor, Estimated(ephemeral, "fake-tensor"))
    return record


job_sizes = st.tuples(st.integers(1, 40 * MiB), st.integers(1, 40 * MiB))
actions = st.lists(st.tuples(st.sampled_from(["submit", "finish", "grow", "swap"]),
                             job_sizes, st.integers(0, 50)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["pack", "fifo", "srtf", "fair"]),
       capacities=st.lists(st.integers(16 * MiB, 96 * MiB), min_size=1, max_size=3),
       script=actions)
def test_every_admitted_job_is_placed(policy: str, capacities: list[int],
                                      script: list[tuple[str, tuple[int, int], int]]) -> None:
    engine, executors = _engine(capacities, policy)
    records: list[JobRecord] = []
    for action, (persistent, ephemeral), pick in script:
        live = [r for r in records if r.live]
        if action == "submit" or not live:
            if aligned(persistent) + aligned(ephemeral) > max(
                    c - c % ALIGNMENT for c in capacities):
                continue  # could never fit: refused at submit, tested elsewhere
            records.append(_open_and_submit(engine, executors, persistent, ephemeral))
        elif action == "finish":
            engine.close(live[pick % len(live)])
        elif action == "grow":  # a measured call found more than the estimate
            record = live[pick % len(live)]
            placed = engine.dispatch.placements(record.job_id)
            if placed:
                _grow(engine, record, (placed[0].device, placed[0].lane_id),
                      ephemeral + 32 * MiB)
        else:
            record = live[pick % len(live)]
            if record.life.phase == "submitted":
                engine.suspend(record, swap=True)
        engine.check_invariants()
        for record in engine.registry:
            if engine.dispatch.placements(record.job_id):
                key = ("job", record.job_id)
                device = engine.dispatch.placements(record.job_id)[0].device
                assert engine.ledgers[device].size(key) == aligned(record.persistent_bytes)
                assert any(isinstance(m, Place) for m in record.executor.sent)


def test_compaction_places_what_fragmentation_would_refuse() -> None:
    ledger = DeviceLedger(8 * ALIGNMENT)
    for i in range(8):
        ledger.place(("job", i), ALIGNMENT)
    for i in range(0, 8, 2):
        ledger.remove(("job", i))
    assert ledger.stats().largest_free == ALIGNMENT  # four holes of one unit each
    ledger.place(("lane", 99), 4 * ALIGNMENT)
    assert ledger.compactions == 1
    ledger.check_invariants()
    with pytest.raises(MemoryError):
        ledger.place(("lane", 100), ALIGNMENT)
