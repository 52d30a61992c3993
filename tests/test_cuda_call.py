"""A job's calls on a CUDA device (salusd/executor/cuda_call.py and its use in runtime.py and
main.py): a call ends after its kernels, its peak is in reserved bytes, an out-of-memory error
comes back with its peak and an `oom` flag (at once, under a lease), and the job's CUDA
generator travels with it, into checkpoints too.

On the CPU, the executor's side is driven through a recording stand-in for the CUDA calls
(`_Recorded`, a `CudaCall` whose torch.cuda calls are replaced); the tests marked `cuda` run
the real ones on a GPU."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from salus.daemon.executor import output
from salus.daemon.executor.batch import BatchJob, DataCursor
from salus.daemon.executor.calls import run_call
from salus.daemon.executor.cap import ProcessCap
from salus.daemon.executor.cuda_call import CudaCall, oom_peak
from salus.daemon.executor.main import Executor
from salus.daemon.executor.runtime import JobRuntime, State
from salus.daemon.executor.slot import Slot
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import Ran, decode_reply, encode

MiB = 2**20
GPU = torch.device("cuda", 0)
DRAIN_S = 0.05  # how long the stand-in's "kernels" run after the function returned
OOM_PEAK = 48 * MiB


class _Recorded(CudaCall):
    """`CudaCall` with its torch.cuda calls replaced by a record of what was called, kernels
    that take `DRAIN_S` to finish after the function returns, a generator state that counts
    the calls, and a failure peak of `OOM_PEAK` for an out-of-memory error."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(GPU, 64 * MiB)
        self.events = events
        self.calls = 0

    def hold(self) -> None:
        self.events.append("hold")

    def persist(self) -> int:
        return 0

    def begin(self, rng: torch.Tensor | None) -> None:
        self.events.append(f"begin {None if rng is None else int(rng[0])}")

    def finish(self) -> torch.Tensor:
        time.sleep(DRAIN_S)
        self.calls += 1
        self.events.append("finish")
        return torch.tensor([self.calls], dtype=torch.uint8)

    def peak(self) -> int:
        self.events.append("peak")
        return 3 * MiB

    def failed(self, exc: BaseException) -> tuple[torch.Tensor | None, int | None]:
        self.events.append(f"failed {type(exc).__name__}")
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        return torch.tensor([99], dtype=torch.uint8), OOM_PEAK if oom else None


def _oom(s: State, x: torch.Tensor) -> None:
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _runtime(events: list[str] | None = None) -> JobRuntime:
    torch.manual_seed(0)
    runtime = JobRuntime()
    runtime.state = State(model=nn.Linear(4, 4))
    runtime.names = ["model"]

    def forward(s: State, x: torch.Tensor) -> torch.Tensor:
        if events is not None:
            events.append("fn")
        return s.model(x)

    runtime.functions[0] = forward
    runtime.kinds[0] = "iteration"
    runtime.functions[1] = _oom
    runtime.kinds[1] = "iteration"
    if events is not None:
        runtime.cuda = _Recorded(events)
    return runtime


def _call(fid: int, x: torch.Tensor | None = None) -> compact.Message:
    return compact.Message(compact.OP_CALL, "1", (torch.ones(2, 4) if x is None else x,), fid)


def test_the_peak_of_an_out_of_memory_call_is_at_least_its_cap() -> None:
    assert oom_peak(reached=300, cap_bytes=1000, baseline=200) == 800
    assert oom_peak(reached=1200, cap_bytes=1000, baseline=200) == 1000
    assert oom_peak(reached=100, cap_bytes=150, baseline=200) == 0


def test_a_call_on_a_cuda_device_ends_after_its_kernels_and_its_generator_travels() -> None:
    events: list[str] = []
    runtime = _runtime(events)
    done, reply = run_call(runtime, _call(0), forward=False)
    assert done.ok and not done.oom and done.peak == 3 * MiB
    assert events == ["begin None", "fn", "finish", "peak"]
    assert done.began is not None and done.ended is not None
    assert done.ended - done.began >= DRAIN_S  # `ended` is taken after the kernels finished
    assert done.seconds >= DRAIN_S
    assert runtime.cuda_rng is not None and int(runtime.cuda_rng[0]) == 1
    events.clear()
    run_call(runtime, _call(0), forward=False)
    assert events == ["begin 1", "fn", "finish", "peak"]  # the job's state, set before the call


def test_out_of_memory_on_a_cuda_device_reports_its_peak_and_flag() -> None:
    events: list[str] = []
    runtime = _runtime(events)
    done, reply = run_call(runtime, _call(1), forward=False)
    assert not done.ok and done.oom and done.peak == OOM_PEAK
    assert reply["type"] == "torch.OutOfMemoryError"
    assert encode(done)["oom"] is True
    assert events == ["begin None", "failed OutOfMemoryError"]
    assert runtime.cuda_rng is not None and int(runtime.cuda_rng[0]) == 99
    done, _ = run_call(runtime, _call(0), forward=False)
    assert done.ok and not done.oom and "oom" not in encode(done)
    failed, _ = run_call(runtime, _call(0, torch.ones(2, 5)), forward=False)  # a shape error
    assert not failed.ok and not failed.oom and failed.peak is None


def test_a_batch_step_out_of_memory_reports_its_peak_and_flag() -> None:
    events: list[str] = []
    runtime = _runtime(events)
    runtime.batch = BatchJob({"model": runtime.state.model}, _oom, [torch.ones(2, 4)] * 3)
    runtime.cursor = DataCursor(runtime.batch.data)
    step = runtime.step()
    assert not step.ok and step.oom and step.peak == OOM_PEAK
    assert encode(step)["oom"] is True


def test_on_the_cpu_an_out_of_memory_error_is_an_ordinary_failure() -> None:
    runtime = _runtime()
    done, _ = run_call(runtime, _call(1), forward=False)
    assert not done.ok and not done.oom and done.peak is None
    assert runtime.cuda is None and runtime.cuda_rng is None


def test_a_leased_call_out_of_memory_is_reported_at_once() -> None:
    """Leased calls are reported in batches every 20 ms; one that ran out of memory is
    reported as soon as it failed, so the daemon can move or queue the job."""
    ours, theirs = socket.socketpair()
    daemon = Channel(theirs)
    theirs.settimeout(5)
    executor = Executor(ours)
    executor.streams = output.Streams({"stdout": sys.stdout, "stderr": sys.stderr})
    slot = Slot(7, _runtime([]), executor.streams.sink(None), None, None, True)
    executor.slots[7] = slot
    slot.turn.lease = True
    slot.queue.append(_call(1))
    executor._run_queued()
    report = daemon.recv()
    assert report.pop("for_job") == 7
    ran = decode_reply(report)
    assert isinstance(ran, Ran)
    assert (ran.calls, ran.failed, ran.oom, ran.peak) == (1, 1, True, OOM_PEAK)
    ours.close()
    theirs.close()


def test_the_jobs_cuda_generator_state_is_checkpointed_and_restored(tmp_path: Path) -> None:
    runtime = _runtime()
    state = torch.arange(16, dtype=torch.uint8)
    runtime.cuda_rng = state
    runtime.checkpoint(str(tmp_path), job=1)
    restored = JobRuntime()
    restored.restore(str(tmp_path))
    assert restored.cuda_rng is not None and torch.equal(restored.cuda_rng, state)


# ---- on a GPU ------------------------------------------------------------------------------
def _gpu_runtime(functions: dict[int, Any], budget_bytes: int | None = None,
                 seed: int = 0) -> JobRuntime:
    torch.manual_seed(seed)
    runtime = JobRuntime()
    runtime._hold({"model": nn.Linear(256, 256)})
    for fid, fn in functions.items():
        runtime.functions[fid], runtime.kinds[fid] = fn, "iteration"
    total = torch.cuda.get_device_properties(GPU).total_memory
    budget = total if budget_bytes is None else budget_bytes
    ProcessCap().book(seed, "cuda:0", 0, budget)  # as `turns.on_place` caps the process
    runtime.place("cuda:0", budget)
    return runtime


def _matmuls(s: State, x: torch.Tensor) -> torch.Tensor:
    a = x.new_ones(4096, 4096)
    for _ in range(40):
        a = (a @ a).clamp_(max=1.0)
    return a[0, :4]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_call_lasts_as_long_as_its_kernels() -> None:
    runtime = _gpu_runtime({0: _matmuls})
    x = torch.ones(1, device=GPU)
    _matmuls(State(), x)  # warm: cuBLAS handles and workspaces
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _matmuls(State(), x)
    end.record()
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1000
    done, _ = run_call(runtime, _call(0, torch.ones(1)), forward=False)
    assert done.ok and done.began is not None and done.ended is not None
    assert done.ended - done.began >= 0.9 * gpu_s, (done.ended - done.began, gpu_s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_calls_peak_is_in_reserved_bytes() -> None:
    nbytes = 64 * MiB + 1  # a large block: the allocator reserves whole 2 MiB pages for it

    def alloc(s: State, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=x.device).fill_(1).sum()

    runtime = _gpu_runtime({0: alloc})
    run_call(runtime, _call(0, torch.ones(1)), forward=False)  # the first call settles state
    torch.cuda.reset_peak_memory_stats(GPU)
    done, _ = run_call(runtime, _call(0, torch.ones(1)), forward=False)
    assert done.ok and done.peak is not None
    assert done.peak >= 66 * MiB and done.peak % (2 * MiB) == 0, done.peak
    assert torch.cuda.max_memory_allocated(GPU) < 66 * MiB  # what the old meter would have read


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_memory_on_a_gpu_reports_at_least_the_cap_and_frees_the_cache() -> None:
    def too_big(s: State, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(2**30, dtype=torch.uint8, device=x.device).sum()

    def small(s: State, x: torch.Tensor) -> torch.Tensor:
        return s.model(x.new_ones(8, 256)).sum()

    try:
        runtime = _gpu_runtime({0: too_big, 1: small}, budget_bytes=64 * MiB)
        assert runtime.cuda is not None
        baseline = runtime.cuda.baseline
        done, reply = run_call(runtime, _call(0, torch.ones(1)), forward=False)
        assert not done.ok and done.oom and reply["type"] == "torch.OutOfMemoryError"
        assert done.peak is not None and done.peak >= 64 * MiB - baseline
        assert torch.cuda.memory_reserved(GPU) <= baseline + 2 * MiB  # the cache was emptied
        ok, _ = run_call(runtime, _call(1, torch.ones(1)), forward=False)
        assert ok.ok and not ok.oom
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, GPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_jobs_in_one_process_keep_their_own_cuda_dropout_streams() -> None:
    def dropout(s: State, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x.new_ones(64), 0.5)

    def seeded(seed: int) -> torch.Tensor:
        torch.cuda.manual_seed(seed)
        return torch.cuda.get_rng_state(GPU)

    def runtime(seed: int) -> JobRuntime:
        r = _gpu_runtime({0: dropout})
        r.cuda_rng = seeded(seed)
        return r

    alone = runtime(1)
    expected = [run_call(alone, _call(0, torch.ones(1)), forward=False)[1] for _ in range(3)]
    a, b = runtime(1), runtime(2)
    got_a, got_b = [], []
    for _ in range(3):
        got_a.append(run_call(a, _call(0, torch.ones(1)), forward=False)[1])
        got_b.append(run_call(b, _call(0, torch.ones(1)), forward=False)[1])
    for mine, theirs in zip(got_a, expected, strict=True):
        assert torch.equal(mine.tensors[0], theirs.tensors[0])
    assert not all(torch.equal(x.tensors[0], y.tensors[0])
                   for x, y in zip(got_a, got_b, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_swapped_out_job_trains_on_exactly_as_one_that_stayed() -> None:
    def train(s: State, x: torch.Tensor) -> torch.Tensor:
        s.opt.zero_grad()
        loss = s.model(x.new_ones(8, 256)).pow(2).mean()
        s.scaler.scale(loss).backward()
        s.scaler.step(s.opt)
        s.scaler.update()
        return loss.detach()

    def runtime() -> JobRuntime:
        torch.manual_seed(0)
        r = JobRuntime()
        model = nn.Linear(256, 256)
        r._hold({"model": model, "opt": torch.optim.Adam(model.parameters(), fused=True),
                 "scaler": torch.amp.GradScaler("cuda")})
        r.functions[0], r.kinds[0] = train, "iteration"
        r.place("cuda:0", torch.cuda.get_device_properties(GPU).total_memory)
        return r

    swapped, stayed = runtime(), runtime()
    for r in (swapped, stayed):
        for _ in range(2):
            run_call(r, _call(0, torch.ones(1)), forward=False)
    held = torch.cuda.memory_allocated(GPU)
    swapped.swap_out()
    assert swapped.device.type == "cpu" and swapped.cuda is None
    assert torch.cuda.memory_allocated(GPU) < held  # its state left the device
    assert not swapped.state.model.weight.is_pinned()  # pageable: the pinned ring is fixed
    swapped.place("cuda:0", torch.cuda.get_device_properties(GPU).total_memory)
    for _ in range(2):
        a = run_call(swapped, _call(0, torch.ones(1)), forward=False)[1]
        b = run_call(stayed, _call(0, torch.ones(1)), forward=False)[1]
        assert torch.equal(a.tensors[0], b.tensors[0])
    for x, y in zip(swapped.state.model.parameters(), stayed.state.model.parameters(),
                    strict=True):
        assert torch.equal(x, y)
