"""Storages copied between host and device in chunks (salusd/executor/transfer.py): the plan
covers every byte once, in order, in chunks no larger than the ring's buffers; the ring's loops
reuse a buffer only after its copy's event; on a GPU a swap-out lands in pageable host memory
through the bounded pinned ring and a swap-in brings back the same bytes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.executor import transfer
from salus.daemon.executor.transfer import Piece, copy_storages, offsets, plan_chunks


@given(st.lists(st.integers(0, 5000), max_size=20), st.integers(1, 3000))
def test_the_plan_covers_every_byte_once_in_bounded_chunks(sizes: list[int],
                                                           chunk: int) -> None:
    chunks = plan_chunks(sizes, chunk)
    # Laid end to end, the pieces are the items' bytes in order: (item, byte) for every byte.
    laid = [(p.item, b) for c in chunks for p in c for b in range(p.start, p.stop)]
    assert laid == [(i, b) for i, size in enumerate(sizes) for b in range(size)]
    total = sum(sizes)
    assert len(chunks) == -(-total // chunk)  # ceil: every chunk but the last is full
    for c in chunks[:-1]:
        assert sum(p.stop - p.start for p in c) == chunk
    assert all(p.stop > p.start for c in chunks for p in c)
    if chunks:
        assert 0 < sum(p.stop - p.start for p in chunks[-1]) <= chunk
    for c in chunks:  # each chunk fills its buffer end to end from 0, in order
        placed = offsets(c)
        assert [p for p, _ in placed] == c
        ends = [at + p.stop - p.start for p, at in placed]
        assert [at for _, at in placed] == [0, *ends[:-1]]
        assert ends[-1] <= chunk


def test_copies_on_the_cpu_are_plain_copies_and_pin_nothing() -> None:
    rings = dict(transfer._rings)
    sources = [torch.arange(n, dtype=torch.uint8) for n in (0, 5, 300)]
    out = copy_storages(sources, torch.device("cpu"), chunk_bytes=4)
    assert all(torch.equal(o, s) for o, s in zip(out, sources, strict=True))
    assert transfer._rings == rings


class _Event:
    """A CUDA event's part the ring loops use: a copy is 'finished' once synchronized."""

    def __init__(self) -> None:
        self.recorded = 0
        self.waited = 0

    def record(self, stream: object) -> None:
        # A buffer may be refilled only after the host waited for its previous copy.
        assert self.recorded == self.waited, "a ring buffer was reused before its copy ended"
        self.recorded += 1

    def synchronize(self) -> None:
        assert self.recorded == self.waited + 1
        self.waited += 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=12), st.integers(1, 300), st.integers(1, 4),
       st.booleans())
def test_the_ring_loops_copy_every_byte_and_reuse_a_buffer_after_its_event(
        sizes: list[int], chunk: int, slots: int, to_host: bool) -> None:
    events: list[_Event] = []

    def event() -> _Event:
        events.append(_Event())
        return events[-1]

    ring = transfer.PinnedRing.__new__(transfer.PinnedRing)
    ring.buffers = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(slots)]
    ring.lock = threading.Lock()
    g = torch.Generator().manual_seed(len(sizes))
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]

    @contextlib.contextmanager
    def on_stream(stream: object) -> Iterator[None]:
        yield

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer.torch.cuda, "Event", event)
        mp.setattr(transfer.torch.cuda, "stream", on_stream)
        loop = transfer._to_host if to_host else transfer._to_device
        loop(sources, targets, plan_chunks(sizes, chunk), ring, object())
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    assert len(events) == slots
    if to_host:  # every buffer was copied out on the host before the loop returned
        assert all(e.recorded == e.waited for e in events)


def test_a_plan_by_hand() -> None:
    assert plan_chunks([5, 0, 3, 9], 4) == [
        [Piece(0, 0, 4)], [Piece(0, 4, 5), Piece(2, 0, 3)], [Piece(3, 0, 4)], [Piece(3, 4, 8)],
        [Piece(3, 8, 9)]]
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([1], 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_swap_goes_through_the_pinned_ring_and_back_bit_equal() -> None:
    gpu = torch.device("cuda", 0)
    generator = torch.Generator().manual_seed(0)
    sizes = [0, 1, 4095, 3 * 2**20 + 7, 256]
    host = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    device = [h.to(gpu) for h in host]
    out = copy_storages(device, torch.device("cpu"), chunk_bytes=2**20)
    assert all(o.device.type == "cpu" and not o.is_pinned() for o in out)
    assert all(torch.equal(o, h) for o, h in zip(out, host, strict=True))
    back = copy_storages(out, gpu, chunk_bytes=2**20)
    assert all(b.device == gpu for b in back)
    assert all(torch.equal(b.cpu(), h) for b, h in zip(back, host, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_memory_stays_within_the_ring_whatever_the_state_size() -> None:
    gpu = torch.device("cuda", 0)
    chunk = 4 * 2**20
    state = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=gpu)
             for n in (40 * 2**20 + 3, 1, 17 * 2**20)]
    transfer.pinned_ring(gpu, chunk)  # the ring itself, made once
    stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned_before = stats().get("allocated_bytes.current") if stats is not None else None
    out = copy_storages(state, torch.device("cpu"), chunk_bytes=chunk)
    back = copy_storages(out, gpu, chunk_bytes=chunk)
    assert all(torch.equal(b, s) for b, s in zip(back, state, strict=True))
    assert not any(o.is_pinned() for o in out)
    assert transfer.pinned_ring(gpu, chunk).nbytes == transfer.RING_SLOTS * chunk
    if pinned_before is not None:  # the host allocator's stats, where this torch has them
        assert stats().get("allocated_bytes.current") == pinned_before
