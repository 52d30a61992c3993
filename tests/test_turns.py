"""One turn machine for every job kind (salusd/executor/turns.py): a contract job's executor
loop and a script job's boundaries both act on the daemon's Lease/Run/Refuse/Exit/Place through
`turns.HANDLERS`, the turn's reports batch leased iterations, and Place's CUDA side (the GPU a
process sees, its cap) holds for a script job too."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from salus.daemon.executor import output, turns
from salus.daemon.executor.boundaries import Boundaries, DeviceMeter
from salus.daemon.executor.cap import Booking, ProcessCap, cap_bytes
from salus.daemon.executor.main import Executor
from salus.daemon.executor.runtime import JobRuntime
from salus.daemon.executor.slot import Slot
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.executor_ops import (
    Ack,
    CallDone,
    Lease,
    Place,
    Ran,
    Ready,
    Run,
    addressed,
    decode_reply,
    encode,
)


def _done(counted: bool = True, oom: bool = False, began: float = 1.0) -> CallDone:
    return CallDone(True, 0.5, 7, counted, began, began + 0.5, oom=oom)


def test_a_turn_asks_once_and_not_while_it_may_go() -> None:
    turn = turns.Turn()
    assert turn.ask(True) == Ready(True)
    assert turn.ask(True) is None  # one Ready with the daemon at a time
    turn.asked = False
    turn.lease = True
    assert turn.ask(True) is None and turn.may_go()


def test_a_granted_iteration_is_owed_its_calldone_and_leased_ones_are_batched() -> None:
    turn = turns.Turn()
    turn.granted = True
    done = _done()
    assert turn.done(done, now=10.0) is done and not turn.granted
    turn.lease = True
    assert turn.done(_done(began=2.0), now=10.0) is None  # noted for a batch
    every = turns.REPORT_EVERY_S
    assert turn.done(_done(counted=False, began=3.0), now=10.0 + every / 2) is None
    ran = turn.done(_done(began=4.0), now=10.0 + 2 * every)  # the batch is due
    assert ran == Ran(3, 2, 0, 1.0, 7, 2.0, 4.5)
    assert turn.report() is None


def test_an_out_of_memory_iteration_under_a_lease_is_reported_at_once() -> None:
    turn = turns.Turn()
    turn.lease = True
    ran = turn.done(_done(oom=True), now=0.0)
    assert isinstance(ran, Ran) and ran.oom and ran.calls == 1


@given(st.lists(st.tuples(st.sampled_from(["cuda:0", "cuda:1", "cpu"]),
                          st.integers(0, 1 << 34), st.integers(0, 1 << 34)), max_size=8))
def test_the_process_cap_is_the_persistent_bytes_plus_the_largest_lane(
        jobs: list[tuple[str, int, int]]) -> None:
    bookings = [Booking(d, p, lane) for d, p, lane in jobs]
    for device in ("cuda:0", "cuda:1"):
        here = [(p, lane) for d, p, lane in jobs if d == device]
        expected = sum(p for p, _ in here) + max((lane for _, lane in here), default=0)
        assert cap_bytes(bookings, device) == expected
        # Every job's whole budget fits under the cap (they take turns in the lane) ...
        for p, lane in here:
            assert p + lane <= cap_bytes(bookings, device)
        # ... and dropping a job never raises it.
        if bookings:
            assert cap_bytes(bookings[1:], device) <= cap_bytes(bookings, device)


# ---- the one table drives both job kinds ---------------------------------------------------
@pytest.fixture
def counted_lease(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """`turns.HANDLERS[Lease]` wrapped to record the job of each call: a change to what a
    lease does is made there once, for every job kind."""
    seen: list[int] = []
    original = turns.HANDLERS[Lease]

    def recording(kind: Any, message: Lease, request: Any, cap: ProcessCap) -> Any:
        seen.append(kind.job)
        return original(kind, message, request, cap)

    monkeypatch.setitem(turns.HANDLERS, Lease, recording)
    yield seen


def _recv_reply(sock: socket.socket) -> Any:
    meta = Channel(sock).recv()
    meta.pop("for_job")
    return decode_reply(meta)


def test_a_contract_job_and_a_script_job_take_a_lease_through_one_handler(
        counted_lease: list[int]) -> None:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    daemon = Channel(theirs)
    executor = Executor(ours)
    executor.streams = output.Streams({"stdout": sys.stdout, "stderr": sys.stderr})
    slot = Slot(3, JobRuntime(), executor.streams.sink(None), None, None, True)
    executor.slots[3] = slot
    daemon.send(addressed(encode(Lease(True)), 3))
    assert executor._from_daemon() is False
    assert decode_reply(_strip(daemon.recv())) == Ack() and slot.turn.lease

    s_ours, s_theirs = socket.socketpair()
    s_theirs.settimeout(5)
    boundaries = Boundaries(Channel(s_ours), 9, estimate=False)
    Channel(s_theirs).send(addressed(encode(Lease(True)), 9))
    boundaries._handle(boundaries.daemon.recv())
    assert _recv_reply(s_theirs) == Ack() and boundaries.turn.lease
    assert counted_lease == [3, 9]
    for sock in (ours, theirs, s_ours, s_theirs):
        sock.close()


def _strip(meta: dict[str, Any]) -> dict[str, Any]:
    meta.pop("for_job")
    return meta


def test_a_script_answers_a_granted_run_at_its_next_boundary() -> None:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    daemon = Channel(theirs)
    boundaries = Boundaries(Channel(ours), 4, estimate=False)
    daemon.send(addressed(encode(Run(True, False)), 4))
    boundaries._handle(boundaries.daemon.recv())
    assert boundaries.turn.granted  # nothing sent yet: the iteration runs first
    boundaries._begin()
    boundaries._end(counted=True)
    done = _recv_reply(theirs)
    assert isinstance(done, CallDone) and done.ok and done.counted
    assert not boundaries.turn.granted
    ours.close()
    theirs.close()


def test_a_script_placed_on_a_gpu_sees_only_that_gpu_and_its_cap_waits_for_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's executor is placed before its first line: CUDA_VISIBLE_DEVICES becomes the
    placed GPU's UUID, the GPU is its cuda:0, its meter reads the device, and the cap waits
    for the script to start CUDA (the executor starts none of its own)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    queued: list[Any] = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    boundaries = Boundaries(Channel(ours), 5, estimate=False)
    place = Place("cuda:1", 96 << 20, 1.0, "GPU-bbbb", lane=2, lane_bytes=64 << 20,
                  workspace_bytes=34 << 20)
    Channel(theirs).send(addressed(encode(place), 5))
    boundaries._handle(boundaries.daemon.recv())
    assert _recv_reply(theirs) == Ack()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
    assert isinstance(boundaries.meter, DeviceMeter)
    assert boundaries.meter.device == "cuda:0"
    assert boundaries.cap.bytes_on("cuda:0") == (96 + 34) << 20  # the workspace beside it
    assert len(queued) == 1  # set when the script starts CUDA
    ours.close()
    theirs.close()


def test_a_script_placed_on_a_gpu_finds_jax_and_tensorflow_held_to_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its first line, in the script's environment: 96 MiB of a 1 GiB GPU is 0.09375,
    written rounded down to 4 digits; what the caller set stays."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                 "TF_FORCE_GPU_ALLOW_GROWTH"):
        monkeypatch.delenv(name, raising=False)  # and removed again after the test
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    boundaries = Boundaries(Channel(ours), 5, estimate=False)
    place = Place("cuda:0", 96 << 20, 1.0, "GPU-aaaa", lane=2, lane_bytes=64 << 20,
                  total_bytes=1 << 30)
    Channel(theirs).send(addressed(encode(place), 5))
    boundaries._handle(boundaries.daemon.recv())
    assert _recv_reply(theirs) == Ack()
    assert {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                           "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                           "XLA_CLIENT_MEM_FRACTION",
                                           "TF_FORCE_GPU_ALLOW_GROWTH")} == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.0937",
        "XLA_CLIENT_MEM_FRACTION": "0.0937", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    ours.close()
    theirs.close()


def test_a_swap_that_would_leave_a_view_of_a_parameter_behind_is_refused() -> None:
    """`suspend --swap` moves a script's parameters in place; a view kept in a local would
    go on with the old storage, so the swap is refused and says why."""
    from salus.daemon.executor.script_swap import unsafe

    weight = torch.nn.Parameter(torch.ones(4, 4))
    moment = torch.zeros(4, 4)
    assert unsafe([weight, moment], [weight, moment, torch.ones(2)]) is None
    row = weight.data[0]  # a view the script kept
    why = unsafe([weight, moment], [weight, moment, row])
    assert why is not None and "1 live tensor(s)" in why


def test_a_callers_gpu_pin_is_honoured_where_it_holds_the_placed_gpu_and_refused_elsewhere(
        ) -> None:
    from salus.daemon.executor.boundaries import pinned_elsewhere

    gpus = "GPU-aaaa-1111,GPU-bbbb-2222"
    assert pinned_elsewhere(None, gpus, "GPU-bbbb-2222") is None  # no pin
    assert pinned_elsewhere("GPU-bbbb", gpus, "GPU-bbbb-2222") is None  # a prefix
    assert pinned_elsewhere("0,1", gpus, "GPU-bbbb-2222") is None  # the daemon's indices
    refused = pinned_elsewhere("0", gpus, "GPU-bbbb-2222")
    assert refused is not None and "GPU-bbbb-2222" in refused and "'0'" in refused
    assert pinned_elsewhere("", gpus, "GPU-aaaa-1111") is not None  # it hides every GPU
