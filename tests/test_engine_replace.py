"""A batch job whose executor ended with a poisoned CUDA context goes on from its checkpoint in
a fresh executor (salusd/engine/replace.py), through the real engine and the shared fake
executor; jobs without a checkpoint, and deaths that were no poisoning, still fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fake_executor import FakeExecutor, FakeExecutors

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.ports import CheckpointPolicy
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.engine.replace import MAX_REPLACEMENTS
from salus.daemon.wire.executor_ops import Load, Place, Step

OWNER = Owner("u", 1000, 1000)
POISONED = ("executor (pid 7) its CUDA context was poisoned by a call of job 1 (CUDA error: an "
            "illegal memory access was encountered), so it ended")
ITERATIONS = 20


class NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _engine(tmp: Path) -> tuple[Engine, FakeExecutors]:
    port = FakeExecutors()
    engine = Engine([64 << 20], "fifo", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=["cpu"],
                    checkpoints=CheckpointPolicy(str(tmp), lambda path, owner: None))
    port.engine = engine
    return engine, port


def _answer_until(port: FakeExecutors, done: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if done():
            return
        executor = next(e for e in port.executors if e.unanswered)
        port.answer(executor)
    raise AssertionError("the engine kept sending")


def _checkpointed_at(engine: Engine, port: FakeExecutors, record: JobRecord,
                     at: int) -> FakeExecutor:
    """Run the job to iteration `at`, checkpoint it there, and run two iterations more."""
    executor = port.executors[-1]
    _answer_until(port, lambda: executor.iterations == at)
    engine.checkpoint(record)
    _answer_until(port, lambda: record.checkpoint.iteration is not None
                  and record.checkpoint.asked == 0 and executor.iterations >= at + 2)
    assert record.checkpoint.iteration is not None
    return executor


def test_a_poisoned_executors_batch_job_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    engine, port = _engine(tmp_path)
    record = engine.submit_batch(OWNER, "b", ITERATIONS, "/jobs/b.py", "make")
    first = _checkpointed_at(engine, port, record, 5)
    at = record.checkpoint.iteration
    assert at is not None and first.iterations > at
    port.die(first, POISONED, poisoned=True)
    assert record.live and record.progress.replacements == 1
    second = port.executors[-1]
    assert second is not first and record.replicas == [second]
    load = second.sent[0]
    assert isinstance(load, Load) and load.restore and load.path == "/jobs/b.py"
    assert engine.dispatch.job(record.job_id) is None  # admitted anew once loaded
    assert engine.core.ledgers[0].stats().used == 0
    replaced = [e for e in engine.events.recent if e.kind == "replaced"]
    assert [(e.job_id, e.detail["resumed_from"]) for e in replaced] == [(record.job_id, at)]
    assert "illegal memory access" in replaced[0].detail["reason"]
    second.iterations = at  # its checkpoint is where it goes on from
    port.answer_all()
    assert record.life.end_state == "finished", record.life.reason
    steps = [m for m in second.sent if isinstance(m, Step)]
    assert len(steps) == ITERATIONS - at  # the iterations after the checkpoint, run again
    assert [m.device for m in second.sent if isinstance(m, Place)] == ["cpu"]
    assert engine.core.done_iterations(record) == ITERATIONS
    engine.check_invariants()


def test_without_a_checkpoint_or_a_poisoning_the_job_fails(tmp_path: Path) -> None:
    engine, port = _engine(tmp_path)
    fresh = engine.submit_batch(OWNER, "fresh", ITERATIONS, "/jobs/f.py", "make")
    _answer_until(port, lambda: port.executors[0].iterations == 3)
    port.die(port.executors[0], POISONED, poisoned=True)
    assert fresh.life.end_state == "failed" and "illegal memory access" in fresh.life.reason
    crashed = engine.submit_batch(OWNER, "crashed", ITERATIONS, "/jobs/c.py", "make")
    executor = _checkpointed_at(engine, port, crashed, 4)
    port.die(executor, "executor (pid 8) died: killed by signal 9 (SIGKILL)")
    assert crashed.life.end_state == "failed" and "SIGKILL" in crashed.life.reason
    assert len(port.executors) == 2  # neither was placed again
    engine.check_invariants()


def test_a_job_that_poisons_every_context_fails_after_its_replacements(tmp_path: Path) -> None:
    engine, port = _engine(tmp_path)
    record = engine.submit_batch(OWNER, "assert", ITERATIONS, "/jobs/a.py", "make")
    executor = _checkpointed_at(engine, port, record, 2)
    for _ in range(MAX_REPLACEMENTS):
        port.die(executor, POISONED, poisoned=True)
        assert record.live
        executor = port.executors[-1]
        executor.iterations = record.checkpoint.iteration or 0
        _answer_until(port, lambda e=executor: e.iterations >= (record.checkpoint.iteration
                                                                or 0) + 1)
    port.die(executor, POISONED, poisoned=True)
    assert record.life.end_state == "failed" and "illegal memory access" in record.life.reason
    assert record.progress.replacements == MAX_REPLACEMENTS
    engine.check_invariants()
