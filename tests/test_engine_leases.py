"""Leases through the engine with the shared fake executor: a job alone in its lane is granted
the lease even when its next `Ready` came with the report of its last iteration (as a script's
does at every boundary), and a job re-admitted into another lane is never granted the new lane
while the old lane's lease is still to be taken back (`Lease` names no lane)."""

from __future__ import annotations

import sys
from pathlib import Path

from fake_executor import FakeExecutor, FakeExecutors

from salus.daemon.engine import script_command
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.wire.executor_ops import Ack, CallDone, Lease, Ran, Ready, Run

MiB = 2**20


class _NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _script(tmp: Path) -> tuple[Engine, FakeExecutors, JobRecord, FakeExecutor]:
    port = FakeExecutors()
    engine = Engine([256 * MiB] * 2, "pack", port, clock=lambda: 0.0, timers=_NoTimers(),
                    torch_devices=["cpu", "cpu"], estimate_first=False)
    port.engine = engine
    command = script_command.check([sys.executable, "train.py"], str(tmp), {}, "never")
    record = engine.run_script(Owner("u", 1000, 1000), "train", 100, command, None)
    executor = record.executor
    port.answer(executor, Ack())  # the script started
    port.unsolicited(executor, Ready(True))  # its first optimizer step asks for a turn
    return engine, port, record, executor


def _to_the_turn(port: FakeExecutors, executor: FakeExecutor) -> None:
    """Answer what the job was sent until its turn is granted (`Run`), left unanswered: the
    script runs to its next boundary."""
    for _ in range(100):
        if executor.unanswered and isinstance(executor.unanswered[0][0], Run):
            return
        port.answer(executor)
    raise AssertionError(f"no turn granted: {executor.sent}")


def _leases(executor: FakeExecutor) -> list[bool]:
    return [m.granted for m in executor.sent if isinstance(m, Lease)]


def test_a_ready_that_came_with_the_last_report_does_not_keep_the_lease_away(
        tmp_path: Path) -> None:
    engine, port, record, executor = _script(tmp_path)
    _to_the_turn(port, executor)  # placed; its turn granted, answered at the next boundary ...
    # ... where the script reports the step and asks for the next at once, read together
    port.answer(executor, CallDone(True, 0.001, MiB, True, 0.0, 0.001))
    port.unsolicited(executor, Ready(True))
    port.answer_all()
    assert _leases(executor) == [True]
    engine.check_invariants()


def test_a_job_moved_to_another_lane_gets_its_lease_only_after_the_old_one_is_back(
        tmp_path: Path) -> None:
    engine, port, record, executor = _script(tmp_path)
    _to_the_turn(port, executor)
    port.answer(executor, CallDone(True, 0.001, MiB, True, 0.0, 0.001))
    port.unsolicited(executor, Ready(True))
    port.answer_all()
    assert _leases(executor) == [True]
    # under the lease an iteration measured far more than its lane: re-admitted elsewhere
    sent_before = len(executor.sent)
    port.unsolicited(executor, Ran(1, 1, 0, 0.001, 200 * MiB, 0.0, 0.001))
    leases_after = [m.granted for m in executor.sent[sent_before:] if isinstance(m, Lease)]
    assert leases_after[:1] == [False], executor.sent[sent_before:]
    port.answer_all()  # the revocation acknowledged: the new lane's lease may follow
    assert _leases(executor)[-1] is True
    engine.check_invariants()
