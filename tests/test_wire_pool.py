"""A job's direct line carries large tensors through one reusable pool per direction
(`salusd/wire/pool.py`): bit-exact, never changing a tensor already received, falling back to a
segment of its own when the receiver has not taken the last frame, and refused by the daemon.
The executor's end lends a call's arguments out of the pool in place and gives them back after
the call; a tensor the job kept retires the pool instead."""

from __future__ import annotations

import array
import fcntl
import gc
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import salus.adapters.torch as salus
from salus.daemon.wire import compact
from salus.daemon.wire.channel import Channel, FrameError
from salus.daemon.wire.frames import FIXED, FLAG_POOL, FLAG_SEGMENT, MAGIC, VERSION, FrameReader
from salus.daemon.wire.pool import PoolReader
from tests.daemon_proc import RunningDaemon, salusd
from tests.executor_proc import leased_job


@pytest.fixture
def line() -> Iterator[tuple[Channel, Channel]]:
    """(client end with a pool, executor end as the executor opens it)."""
    a, b = socket.socketpair()
    client, executor = Channel(a, pool=True), Channel(b)
    yield client, executor
    client.close()
    executor.close()


def mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"memfd:{name}" in line for line in f)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def call(*tensors: torch.Tensor) -> compact.Message:
    return compact.Message(compact.OP_CALL, "1", tensors, 0)


def test_calls_reuse_one_pool_bit_exact_and_keep_received_tensors(
        line: tuple[Channel, Channel]) -> None:
    client, executor = line
    gc.collect()  # segments an earlier test in this process left to the collector go now
    segments = mappings("salus-tensors")
    sent = [torch.randn(512, 512) for _ in range(5)]  # 1 MiB each: over the shm threshold
    sent[2][0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    received = []
    for x in sent:
        client.send(call(x))
        received.append(executor.recv().tensors[0])
        assert mappings("salus-pool") == 2  # the client's pool, mapped by each end once
    assert mappings("salus-tensors") == segments  # no segment of its own per call
    for x, got in zip(sent, received, strict=True):
        assert torch.equal(bits(got), bits(x))  # the first is unchanged by the four after it


def test_the_executor_answers_through_a_pool_of_its_own(line: tuple[Channel, Channel]) -> None:
    client, executor = line
    client.send(call(torch.ones(2)))  # small: announces the client's pool all the same
    executor.recv()
    for _ in range(3):
        result = torch.randn(1024, 300)
        executor.send(compact.Message(compact.OP_RESULT, tensors=(result,),
                                      aux=compact.KIND_TENSOR))
        assert torch.equal(bits(client.recv().tensors[0]), bits(result))
    assert mappings("salus-pool") == 4


def test_a_frame_sent_before_the_last_was_taken_gets_a_segment_of_its_own(
        line: tuple[Channel, Channel]) -> None:
    client, executor = line
    first, second = torch.randn(300, 1024), torch.randn(300, 1024)
    client.send(call(first))
    client.send(call(second))  # the executor has not read the first yet
    got_first = executor.recv().tensors[0]
    got_second = executor.recv().tensors[0]
    assert mappings("salus-tensors") == 1  # the second's, mapped while it is alive
    assert torch.equal(bits(got_first), bits(first))
    assert torch.equal(bits(got_second), bits(second))


def test_a_larger_frame_gets_a_larger_pool(line: tuple[Channel, Channel]) -> None:
    client, executor = line
    for rows in (256, 4096, 256):  # 256 KiB, 4 MiB (a new pool), then into it again
        x = torch.randn(rows, 256)
        client.send(call(x, torch.arange(rows)))
        got = executor.recv().tensors
        assert torch.equal(bits(got[0]), bits(x)) and torch.equal(got[1], torch.arange(rows))
    assert mappings("salus-pool") == 2


def mapping_of(t: torch.Tensor) -> str:
    """The name of this process's mapping that holds `t`'s bytes ("" when anonymous)."""
    at = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(a, 16) for a in fields[0].split("-"))
            if low <= at < high:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError("the tensor's memory is in no mapping")


@pytest.fixture
def lending() -> Iterator[tuple[Channel, Channel]]:
    """(client end with a pool, executor end that borrows its arguments in place)."""
    a, b = socket.socketpair()
    client, executor = Channel(a, pool=True), Channel(b, borrow=True)
    yield client, executor
    client.close()
    executor.close()


def test_arguments_are_lent_in_place_and_given_back(
        lending: tuple[Channel, Channel]) -> None:
    client, executor = lending
    places = set()
    for _ in range(3):
        x = torch.randn(512, 512)
        client.send(call(x))
        got = executor.recv().tensors[0]
        assert "memfd:salus-pool" in mapping_of(got)  # no copy: it views the pool
        assert torch.equal(bits(got), bits(x))
        places.add(got.data_ptr())
        del got
        executor.give_back()
    assert len(places) == 1  # the same pool, taken back after each call
    assert mappings("salus-pool") == 2 and executor.borrow


def test_a_kept_argument_retires_the_pool_and_never_changes(
        lending: tuple[Channel, Channel]) -> None:
    client, executor = lending
    first = torch.randn(512, 512)
    client.send(call(first))
    kept = executor.recv().tensors[0]
    executor.give_back()  # the job still holds `kept`: the pool must not be written again
    assert not executor.borrow  # from now on this line copies its pooled frames
    later = [torch.randn(512, 512) for _ in range(3)]
    for x in later:
        client.send(call(x))
        got = executor.recv().tensors[0]
        assert torch.equal(bits(got), bits(x))
        assert "salus-pool" not in mapping_of(got)  # a copy of its own
        executor.give_back()
    assert torch.equal(bits(kept), bits(first))
    assert mappings("salus-pool") == 3  # the retired pool, kept for `kept`, and the new one
    del kept
    assert mappings("salus-pool") == 2  # unmapped with the last tensor that viewed it


def test_a_frame_sent_while_one_is_lent_gets_a_segment_of_its_own(
        lending: tuple[Channel, Channel]) -> None:
    client, executor = lending
    first, second = torch.randn(300, 1024), torch.randn(300, 1024)
    client.send(call(first))
    got_first = executor.recv().tensors[0]
    client.send(call(second))  # the executor has not given the first back yet
    got_second = executor.recv().tensors[0]
    assert "salus-tensors" in mapping_of(got_second)
    assert torch.equal(bits(got_first), bits(first))
    assert torch.equal(bits(got_second), bits(second))


def pooled_frame(flags: int) -> bytes:
    header = compact.encode(call(), shm_threshold=float("inf")).header
    return FIXED.pack(MAGIC, VERSION, flags, 0, len(header), 0) + header


def test_the_daemon_refuses_a_pooled_frame() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(pooled_frame(FLAG_POOL | 0x2))
        with pytest.raises(FrameError, match="malformed frame"):
            FrameReader(b).read(0.0)


def test_a_pool_that_could_shrink_is_refused(line: tuple[Channel, Channel]) -> None:
    client, executor = line
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    try:
        client.sock.sendmsg([pooled_frame(FLAG_POOL | FLAG_SEGMENT | 0x2)],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        os.close(fd)
    with pytest.raises(FrameError, match="sealed against shrinking") as err:
        executor.recv()
    assert err.value.recoverable
    with pytest.raises(ValueError, match="before the pool came"):
        PoolReader().take()
    assert fcntl.F_SEAL_SHRINK  # the seal the pool relies on exists here


def _echo_and_keep(s: Any, x: torch.Tensor) -> torch.Tensor:
    s.kept.append(x)
    return x * 1


def _kept(s: Any) -> list[torch.Tensor]:
    return s.kept


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with salusd(tmp_path_factory.mktemp("salusd"), devices=1) as running:
        yield running


def test_a_pooled_line_through_a_real_daemon_is_bit_exact(daemon: RunningDaemon) -> None:
    sent = [torch.randn(512, 1024) for _ in range(4)]  # 2 MiB each way, every call
    with salus.connect(name="pool", iterations=10, address=daemon.address) as job:
        remote = job.attach(kept=[])
        echo = remote.function(_echo_and_keep)
        for x in sent:
            assert torch.equal(bits(echo(x)), bits(x))
        kept = remote.call(_kept)  # what the job held on to, after three more calls
        job.close(pull=False)
    assert len(kept) == len(sent)
    for x, held in zip(sent, kept, strict=True):
        assert torch.equal(bits(held), bits(x))


def _where_or_fail(s: Any, x: torch.Tensor) -> str:
    if float(x.flatten()[0]) == 0.0:
        raise ValueError("a failed call")
    return mapping_of(x)


def test_a_job_that_keeps_nothing_reads_its_arguments_in_the_pool(daemon: RunningDaemon) -> None:
    with salus.connect(name="lent", iterations=10, address=daemon.address) as job:
        where = job.attach(w=torch.zeros(1)).function(_where_or_fail)
        places = [where(torch.rand(512, 1024) + 1) for _ in range(3)]
        with pytest.raises(ValueError, match="a failed call"):  # its frames held the argument
            where(torch.zeros(512, 1024))
        places += [where(torch.rand(512, 1024) + 1) for _ in range(3)]
        job.close(pull=False)
    assert all("memfd:salus-pool" in place for place in places), places


def _where_slowly(s: Any, x: torch.Tensor) -> torch.Tensor:
    """Whether `x` is read in the client's pool; 0.3 s long when its first element is 0."""
    if float(x.flatten()[0]) == 0.0:
        time.sleep(0.3)
    return torch.tensor(float("memfd:salus-pool" in mapping_of(x)))


@pytest.mark.slow
def test_the_pool_is_given_back_once_its_call_ran_while_later_calls_wait(
        tmp_path: Path) -> None:
    """A (through the pool) and B (small, in the frame) arrive together, and C is sent while
    B runs: it finds the pool given back after A ran, not once the queue is empty."""
    with leased_job(tmp_path, _where_slowly, pool=True) as (_, client):
        client.send_many([call(torch.zeros(512, 512)), call(torch.zeros(16))])  # one sendmsg
        first = client.recv()
        assert not isinstance(first, dict), first
        in_pool = [float(first.tensors[0])]  # A's answer; B runs now for 0.3 s
        client.send(call(torch.ones(512, 512)))  # C
        in_pool += [float(client.recv().tensors[0]) for _ in range(2)]
    assert in_pool == [1.0, 0.0, 1.0]
