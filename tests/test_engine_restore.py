"""Restoring a job after a restart, through the real engine and the shared fake executor."""

from __future__ import annotations

from fake_executor import FakeExecutors

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.job_spec import JobSpec
from salus.daemon.engine.ports import CheckpointPolicy
from salus.daemon.engine.registry import Owner
from salus.daemon.wire.executor_ops import Loaded

OWNER = Owner("u", 1000, 1000)
BATCH = JobSpec(path="/j.py", function="make")


class NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _engine(tmp: str) -> tuple[Engine, FakeExecutors]:
    port = FakeExecutors()
    engine = Engine([64 << 20], "fifo", port, clock=lambda: 0.0, timers=NoTimers(),
                    torch_devices=["cpu"],
                    checkpoints=CheckpointPolicy(tmp, lambda path, owner: None))
    port.engine = engine
    return engine, port


def test_a_restored_job_shows_its_recorded_checkpoint_until_loaded(tmp_path) -> None:
    engine, port = _engine(str(tmp_path))
    engine.restore(OWNER, 7, "b", 40, "batch", BATCH, 1.0, 25,
                   1.7e9, 4096)
    record = engine.registry.live[7]
    assert (record.progress.done_before, record.checkpoint.iteration, record.checkpoint.time,
            record.checkpoint.bytes) == (25, 25, 1.7e9, 4096)
    port.answer(port.executors[0], Loaded(1 << 20, 30))  # a later checkpoint on disk
    progress = record.progress
    assert (progress.resumed_from, progress.done_before, record.checkpoint.iteration) == (
        30, 30, 30)
    assert record.live


def test_a_restored_job_whose_checkpoint_cannot_be_read_fails_and_says_why(tmp_path) -> None:
    engine, port = _engine(str(tmp_path))
    engine.restore(OWNER, 8, "b", 40, "batch", BATCH, 1.0, 25)
    port.answer(port.executors[0], Loaded(1 << 20, 0))  # the executor found no checkpoint
    record = engine.registry.ended[8]
    assert record.life.end_state == "failed"
    assert "iteration 25 could not be read" in record.life.reason
    assert engine.dispatch.job(8) is None  # never submitted: it holds no memory
