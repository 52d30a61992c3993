"""A script that sets `CUDA_VISIBLE_DEVICES` itself is placed on a GPU it names: the pin read as
CUDA reads it (`devices.pinned_gpus`), admission restricted to those devices (`Job.devices`),
and the engine placing a pinned script there though another GPU is emptier, or refusing a pin
that names no GPU of the node at submission. The engine runs with the shared fake executor and
GPU device names; the executor's own check of the pin is in test_turns.py."""

from __future__ import annotations

import sys

import pytest
from fake_executor import FakeExecutors

from salus.daemon.devices.discovery import pinned_gpus
from salus.daemon.engine import script_command
from salus.daemon.engine.engine import Engine
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.engine.report import snapshot
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.executor_ops import Ack, Place
from salus.scheduler.job import Job
from salus.scheduler.lanes import LaneManager

MiB = 2**20
GPUS = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-bbcc-3333"]


def test_the_pin_is_read_as_cuda_reads_it() -> None:
    assert pinned_gpus("1", GPUS) == [1]
    assert pinned_gpus("2,0", GPUS) == [2, 0]  # in the pin's order
    assert pinned_gpus("GPU-aaaa-1111", GPUS) == [0]
    assert pinned_gpus("GPU-bbcc", GPUS) == [2]  # a unique prefix
    assert pinned_gpus("GPU-bb", GPUS) == []  # an ambiguous one names nothing, and ends it
    assert pinned_gpus("0,7,1", GPUS) == [0]  # CUDA stops at the first entry naming no GPU
    assert pinned_gpus("1,1,2", GPUS) == [1]  # ... or one named already
    assert pinned_gpus("", GPUS) == [] and pinned_gpus("-1", GPUS) == []  # hides every GPU


def test_admission_places_a_job_only_on_its_devices() -> None:
    lanes = LaneManager([100 * MiB] * 3, "single")
    lanes.submit(Job(1, 0.0, 10, 10 * MiB, 10 * MiB))  # device 0 busy: 1 and 2 are emptier
    (placed,) = lanes.submit(Job(2, 1.0, 10, 10 * MiB, 10 * MiB, devices=frozenset({0})))
    assert placed.device == 0
    (free,) = lanes.submit(Job(3, 2.0, 10, 10 * MiB, 10 * MiB, devices=frozenset({1, 2})))
    assert free.device == 1
    with pytest.raises(ValueError, match=r"among the devices it may use, \[2\]"):
        LaneManager([100 * MiB, 10 * MiB, 10 * MiB]).submit(
            Job(4, 0.0, 10, 30 * MiB, 0, devices=frozenset({2})))
    lanes.check_invariants()


class _NoTimers:
    def call_later(self, delay_s: float, fn: object) -> None:
        pass


def _engine(gpus: list[str]) -> tuple[Engine, FakeExecutors]:
    port = FakeExecutors()
    engine = Engine([1024 * MiB] * len(gpus), "fifo", port, clock=lambda: 0.0,
                    timers=_NoTimers(), torch_devices=[f"cuda:{i}" for i in range(len(gpus))],
                    estimate_first=False, gpu_uuids=gpus)
    port.engine = engine
    return engine, port


def _script(engine: Engine, port: FakeExecutors, tmp: str, pin: str | None) -> JobRecord:
    env = {} if pin is None else {"CUDA_VISIBLE_DEVICES": pin}
    command = script_command.check([sys.executable, "train.py"], tmp, env, "never")
    record = engine.run_script(Owner("u", 1000, 1000), "train", 10, command, None)
    port.answer(record.executor, Ack())  # the script started
    port.ready(record.executor, {})  # its first optimizer step asks for a turn
    return record


def _placed_on(record: JobRecord) -> list[str]:
    return [m.device for m in record.executor.sent if isinstance(m, Place)]


def test_a_pinned_script_goes_to_its_gpu_and_an_unpinned_one_where_admission_prefers(
        tmp_path: object) -> None:
    engine, port = _engine(GPUS)
    first = _script(engine, port, str(tmp_path), None)
    assert _placed_on(first) == ["cuda:0"]
    pinned = _script(engine, port, str(tmp_path), "GPU-aaaa")  # beside it, not on an empty GPU
    assert _placed_on(pinned) == ["cuda:0"]
    free = _script(engine, port, str(tmp_path), None)
    assert _placed_on(free) == ["cuda:1"]
    by_index = _script(engine, port, str(tmp_path), "1")  # not on empty GPU 2
    assert _placed_on(by_index) == ["cuda:1"]
    engine.check_invariants()


def test_a_pin_naming_no_gpu_of_the_node_is_refused_at_submission(tmp_path: object) -> None:
    engine, port = _engine(GPUS)
    command = script_command.check([sys.executable, "train.py"], str(tmp_path),
                            {"CUDA_VISIBLE_DEVICES": "GPU-ffff"}, "never")
    with pytest.raises(BadRequest, match=r"CUDA_VISIBLE_DEVICES='GPU-ffff' names no GPU\(s\) "
                                         r"of this node .* \(GPU-aaaa-1111, GPU-bbbb-2222"):
        engine.run_script(Owner("u", 1000, 1000), "train", 10, command, None)
    assert snapshot(engine)["jobs"] == [] and port.executors == []  # nothing left behind


def test_on_cpu_devices_the_pin_is_the_scripts_own_business(tmp_path: object) -> None:
    port = FakeExecutors()
    engine = Engine([1024 * MiB] * 2, "fifo", port, clock=lambda: 0.0, timers=_NoTimers(),
                    torch_devices=["cpu", "cpu"], estimate_first=False)
    port.engine = engine
    record = _script(engine, port, str(tmp_path), "7")
    assert _placed_on(record) == ["cpu"]
