"""CUDA faults in an executor (salusd/executor/cuda_errors.py, main.py): out-of-memory errors of
every library that allocates on the device count as `oom`; a sticky error (illegal address,
device-side assert) ends the executor after its reply, failing what waits there; and each job's
CUDA generator starts from its client's seed.

On the CPU the CUDA side of a call is the recording stand-in of tests/test_cuda_call.py and the
errors are the texts CUDA, cuBLAS, NCCL and cupy raise; the GPU kit runs the real ones."""

from __future__ import annotations

import socket
import sys

import cloudpickle
import pytest
import torch

from salus.daemon.executor import output
from salus.daemon.executor.cuda_call import seeded_state
from salus.daemon.executor.cuda_errors import is_oom, is_sticky
from salus.daemon.executor.main import Executor
from salus.daemon.executor.runtime import JobRuntime, State
from salus.daemon.executor.slot import Slot
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.codec import PickledPayload
from salus.daemon.wire.executor_ops import (
    CallDone,
    Poisoned,
    Ran,
    Ready,
    Run,
    addressed,
    decode_reply,
    encode,
)
from tests.test_cuda_call import _call, _runtime

ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be..."


@pytest.mark.parametrize("exc", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version "
                 "2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                 "Last error:\nCuda failure 2 'out of memory'"),
    RuntimeError("cudaErrorMemoryAllocation: out of memory"),
    type("OutOfMemoryError", (MemoryError,), {})("Out of memory allocating 1,073,741,824 bytes"),
])
def test_every_librarys_out_of_memory_is_oom_and_not_sticky(exc: BaseException) -> None:
    assert is_oom(exc) and not is_sticky(exc)


@pytest.mark.parametrize("text", [
    ILLEGAL,
    "CUDA error: device-side assert triggered",
    "CUDA error: misaligned address",
    "cudaErrorIllegalAddress: an illegal memory access was encountered",
])
def test_context_poisoning_errors_are_sticky(text: str) -> None:
    assert is_sticky(RuntimeError(text)) and not is_oom(RuntimeError(text))


def test_ordinary_errors_are_neither() -> None:
    for exc in (ValueError("shapes (2, 4) and (5, 4) cannot be multiplied"),
                RuntimeError("expected scalar type Float but found Half")):
        assert not is_oom(exc) and not is_sticky(exc)


def _illegal(s: State, x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(ILLEGAL)


def test_a_sticky_error_ends_the_executor_and_fails_what_waits_there() -> None:
    """Job 1's leased call hits an illegal address: its client gets the error, the daemon a
    `Poisoned` for job 1 after what ran, and job 2's waiting call is refused, not run on the
    poisoned context."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    daemon = Channel(theirs)
    executor = Executor(ours)
    executor.streams = output.Streams({"stdout": sys.stdout, "stderr": sys.stderr})
    clients = {}
    for job in (1, 2):
        runtime = _runtime([])
        runtime.functions[2], runtime.kinds[2] = _illegal, "iteration"
        slot = Slot(job, runtime, executor.streams.sink(None), None, None, True)
        executor.slots[job] = slot
        mine, client = socket.socketpair()
        client.settimeout(5)
        executor._attach_channel(slot, mine.detach())
        clients[job] = Channel(client)
    executor.slots[1].turn.lease = True
    executor.slots[1].queue.append(_call(2))
    executor.slots[2].turn.lease = True
    executor.slots[2].queue.append(_call(0))
    executor._run_queued()
    assert executor.poisoned is executor.slots[1]
    assert executor.slots[1].runtime.poisoned is not None
    executor._end_poisoned(executor.slots[1])
    first = clients[1].recv()
    assert first["ok"] is False and "illegal memory access" in first["message"]
    refused = clients[2].recv()
    assert refused["ok"] is False and refused["code"] == "unavailable"
    assert "poisoned by a call of job 1" in refused["message"]
    replies = []
    for _ in range(2):
        meta = daemon.recv()
        replies.append((meta.pop("for_job"), decode_reply(meta)))
    assert isinstance(replies[0][1], Ran) and replies[0][0] == 1 and replies[0][1].failed == 1
    assert replies[1][0] == 1 and isinstance(replies[1][1], Poisoned)
    assert "illegal memory access" in replies[1][1].message
    for sock in (ours, theirs):
        sock.close()


def test_a_jobs_generator_starts_from_its_clients_seed() -> None:
    """The client's `torch.manual_seed(s)` seeds every device: the job's generator on its
    device starts from `s` too, whatever the process's own generator drew before."""
    a, b = JobRuntime(), JobRuntime()
    for runtime, seed in ((a, 11), (b, 12)):
        torch.manual_seed(seed)
        client_rng = torch.get_rng_state()
        torch.manual_seed(999)  # the executor's own stream meanwhile
        runtime.attach({"objects": _pickled({"w": torch.ones(2)}), "rng": client_rng})
    assert (a.seed, b.seed) == (11, 12)
    expected = torch.Generator().manual_seed(11).get_state()
    assert torch.equal(seeded_state(torch.device("cpu"), a.seed), expected)
    assert not torch.equal(seeded_state(torch.device("cpu"), b.seed), expected)


def _pickled(objects: dict[str, object]) -> PickledPayload:
    return PickledPayload(cloudpickle.dumps(objects), [])


def test_a_call_out_of_memory_with_its_state_intact_runs_again_once_placed_anew() -> None:
    """The first guess of a lane was small: the leased call that ran out of memory without
    touching the state is not failed to its client; the daemon hears of it at once, the call
    waits at the head of the queue (`Ready`), and runs when granted, answering the client
    once, as a direct run would."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(5)
    daemon = Channel(theirs)
    executor = Executor(ours)
    executor.streams = output.Streams({"stdout": sys.stdout, "stderr": sys.stderr})
    runtime = _runtime([])
    tries: list[int] = []

    def first_too_big(s: State, x: torch.Tensor) -> torch.Tensor:
        tries.append(1)
        if len(tries) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return s.model(x)

    runtime.functions[3], runtime.kinds[3] = first_too_big, "iteration"
    slot = Slot(1, runtime, executor.streams.sink(None), None, None, True)
    executor.slots[1] = slot
    mine, client_sock = socket.socketpair()
    client_sock.settimeout(5)
    executor._attach_channel(slot, mine.detach())
    client = Channel(client_sock)
    slot.turn.lease = True
    slot.queue.append(_call(3))
    executor._run_queued()
    got = []
    for _ in range(2):
        meta = daemon.recv()
        got.append((meta.pop("for_job"), decode_reply(meta)))
    (_, ran), (_, ready) = got
    assert isinstance(ran, Ran) and ran.oom and ran.iterations == 0
    assert isinstance(ready, Ready) and len(slot.queue) == 1 and not slot.turn.lease
    assert runtime.iterations == 0 and not client.readable(0)  # the client still waits
    daemon.send(addressed(encode(Run(True, False)), 1))
    assert executor._from_daemon() is False
    meta = daemon.recv()
    meta.pop("for_job")
    done = decode_reply(meta)
    assert isinstance(done, CallDone) and done.ok and done.counted
    reply = client.recv()
    assert reply.tensors[0].shape == (2, 4) and len(tries) == 2
    assert runtime.iterations == 1 and not slot.queue
    for sock in (ours, theirs, client_sock):
        sock.close()


def test_a_call_out_of_memory_after_writing_the_state_fails_as_before() -> None:
    """A call that changed the state before it ran out of memory (here, a parameter written in
    place) cannot run again as if it had not run: its client gets the error."""
    runtime = _runtime([])

    def write_then_oom(s: State, x: torch.Tensor) -> None:
        with torch.no_grad():
            s.model.weight.add_(1.0)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    runtime.functions[3], runtime.kinds[3] = write_then_oom, "iteration"
    reply, seconds, peak = runtime.run(_call(3))
    assert reply["ok"] is False and not runtime.retry and peak is not None
