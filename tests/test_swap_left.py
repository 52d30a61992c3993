"""What a contract job's swap-out leaves on its device (salusd/executor/left_behind.py and
`JobRuntime.swap_out`), and the daemon's record of it: the executor's `Swapped` reply becomes a
`swapped_out` event of the job (a gang's replicas summed). The engine runs for real with the
shared fake executors (`tests/fake_executor.py`); the measure itself needs a CUDA device."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from fake_executor import FakeExecutors
from torch import nn

from salus.daemon.engine.engine import Engine
from salus.daemon.engine.gang import merge
from salus.daemon.engine.registry import JobRecord, Owner
from salus.daemon.executor.left_behind import device_bytes_left
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.wire.executor_ops import Ack, Attached, Estimated, SwapOut, Swapped
from salus.daemon.wire.frames import json_frame

MiB = 2**20


class NoTimers:
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        pass


def _swapped_job(reply: Ack | Swapped) -> list[dict[str, object]]:
    """A job admitted, suspended with `--swap` and answered `reply` by its executor: the
    details of its `swapped_out` events."""
    executors = FakeExecutors()
    clock = iter(range(10**9))
    engine = Engine([64 * MiB], "fifo", executors, clock=lambda: float(next(clock)),
                    timers=NoTimers(), torch_devices=["cpu"])
    executors.engine = engine
    record: JobRecord = engine.open(Owner("u", 1000, 1000), "job", 100, None)
    engine.attach(record, json_frame({}), lambda f: None)
    executors.answer(record.executor, Attached(MiB, 1, forward=True), json_frame({"ok": True}))
    engine.call(record, json_frame({}), lambda f: None, counted=True)
    executors.answer(record.executor, Estimated(MiB, "fake-tensor"))
    executors.answer_all()
    engine.suspend(record, swap=True)
    executor = record.executor
    assert any(isinstance(m, SwapOut) for m in executor.sent)
    while executor.unanswered:
        swap_out = isinstance(executor.unanswered[0][0], SwapOut)
        executors.answer(executor, reply if swap_out else None)
    return [e.detail for e in engine.events.recent if e.kind == "swapped_out"]


def test_the_daemon_records_what_a_swap_out_left_in_the_jobs_events() -> None:
    assert _swapped_job(Swapped({"device_bytes_left": 3 * MiB})) == [
        {"device_bytes_left": 3 * MiB}]
    assert _swapped_job(Ack()) == []  # an executor that reports nothing: nothing recorded


def test_a_gangs_replicas_left_bytes_are_summed() -> None:
    replies = [Swapped({"device_bytes_left": n}) for n in (5, 7)]
    assert merge(replies) == Swapped({"device_bytes_left": 12})
    script = [Swapped({"device_bytes_left": None, "note": "x"})] * 2
    assert merge(script) == Swapped({"device_bytes_left": None, "note": "x"})


def test_on_a_cpu_device_nothing_is_left() -> None:
    runtime = JobRuntime()
    runtime._hold({"model": nn.Linear(4, 4)})
    assert runtime.swap_out() == {"device_bytes_left": 0}
    assert device_bytes_left(torch.device("cpu"), [torch.ones(3)]) == 0


class _Opaque:
    """A plain object: the state walk does not look inside it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_swap_out_reports_the_device_bytes_its_job_left() -> None:
    gpu = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(gpu).total_memory

    def job(stray: bool) -> JobRuntime:
        runtime = JobRuntime()
        runtime._hold({"model": nn.Linear(1024, 1024)})
        runtime.place("cuda:0", total)
        if stray:  # made on the device by the job, where the swap cannot reach it
            runtime.state.hidden = _Opaque(torch.ones(MiB // 4, device=gpu))  # 1 MiB
            runtime.names.append("hidden")
        return runtime

    gc.collect()
    torch.cuda.synchronize(gpu)
    base = torch.cuda.memory_allocated(gpu)  # what earlier tests of this process still hold
    clean, other = job(stray=False), job(stray=False)
    assert clean.swap_out([other.state.model])["device_bytes_left"] == base
    assert other.state.model.weight.device == gpu
    assert other.swap_out()["device_bytes_left"] == base
    leaky = job(stray=True)
    assert leaky.swap_out()["device_bytes_left"] == base + MiB
    assert leaky.state.model.weight.device.type == "cpu"
