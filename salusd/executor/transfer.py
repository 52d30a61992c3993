"""Copying a job's storages between host and device memory, in bounded chunks.

Between the CPU and a CUDA device the bytes go through a fixed ring of pinned host buffers
(`PinnedRing`: `RING_SLOTS` buffers of `CHUNK_BYTES`, made once per process and chunk size),
so the page-locked memory a swap holds stays bounded whatever the state's size; the host side
of the state lives in ordinary pageable tensors. `plan_chunks` cuts the storages, laid end to
end, into chunks of one buffer each. A swap-out copies chunk i from the device into buffer
i mod `RING_SLOTS` (`non_blocking=True` on a side stream, then an event), and the host copies
a buffer out into the pageable tensors once its event has completed, while the next chunks'
copies run; a swap-in fills a buffer on the host once its previous copy to the device has
completed, then copies it to the device on the side stream. The side stream first waits for the
job's stream, so the state's last writes are copied; device destinations are allocated on the
job's stream, where they will be used (the caching allocator reuses a block only on the stream
that allocated it); one synchronisation ends the copy. Anything else (CPU to CPU, one GPU to
another) is one `Tensor.to` per storage.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_BYTES = 64 * 2**20
RING_SLOTS = 2


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes `start` to `stop` (exclusive) of item `item`."""

    item: int
    start: int
    stop: int


def plan_chunks(sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES) -> list[list[Piece]]:
    """Items of `sizes` bytes, taken in order as one run of bytes, cut into chunks of
    `chunk_bytes` (the last may be shorter): each chunk the pieces of items it holds. Every
    byte of every item is in exactly one piece; an empty item is in none."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for item, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append(Piece(item, start, start + take))
            start += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def offsets(chunk: Sequence[Piece]) -> list[tuple[Piece, int]]:
    """Each piece of `chunk` with where it sits in the chunk's buffer (bytes): end to end
    from 0, in order."""
    placed, at = [], 0
    for piece in chunk:
        placed.append((piece, at))
        at += piece.stop - piece.start
    return placed


class PinnedRing:
    """`slots` pinned host buffers of `slot_bytes` each, and the event of each one's last copy;
    one copy uses the ring at a time (`lock`)."""

    def __init__(self, slot_bytes: int, slots: int = RING_SLOTS) -> None:
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(slots)]
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Pinned bytes the ring holds."""
        return sum(b.numel() for b in self.buffers)


_rings: dict[int, PinnedRing] = {}
_rings_lock = threading.Lock()


def pinned_ring(gpu: torch.device, slot_bytes: int = CHUNK_BYTES) -> PinnedRing:
    """This process's ring of `slot_bytes` buffers, made on first use with `gpu` current (so
    pinning creates no context on another device)."""
    with _rings_lock:
        ring = _rings.get(slot_bytes)
        if ring is None:
            with torch.cuda.device(gpu):
                ring = _rings[slot_bytes] = PinnedRing(slot_bytes)
        return ring


def copy_storages(sources: Sequence[torch.Tensor], device: torch.device,
                  chunk_bytes: int = CHUNK_BYTES) -> list[torch.Tensor]:
    """Copies on `device` of `sources`: 1-D uint8 tensors on one device, each a whole storage.
    Between the CPU and a CUDA device, through the process's ring of pinned buffers of
    `chunk_bytes` (see the module's docstring), into pageable host tensors or from them; the
    copies are complete when this returns."""
    if not sources:
        return []
    source = sources[0].device
    if {source.type, device.type} != {"cpu", "cuda"}:
        return [s.to(device) for s in sources]
    gpu = device if device.type == "cuda" else source
    job_stream = torch.cuda.current_stream(gpu)
    side = torch.cuda.Stream(gpu)
    targets = [torch.empty(s.numel(), dtype=torch.uint8, device=device) for s in sources]
    plan = plan_chunks([s.numel() for s in sources], chunk_bytes)
    ring = pinned_ring(gpu, chunk_bytes)
    side.wait_stream(job_stream)
    with ring.lock:
        if device.type == "cpu":
            _to_host(sources, targets, plan, ring, side)
        else:
            _to_device(sources, targets, plan, ring, side)
        side.synchronize()
    return targets


def _to_host(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
             plan: list[list[Piece]], ring: PinnedRing, side: torch.cuda.Stream) -> None:
    """Device -> buffer on `side`; buffer -> pageable `targets` on the host once copied."""
    events = [torch.cuda.Event() for _ in ring.buffers]
    pending: deque[tuple[list[Piece], int]] = deque()

    def drain() -> None:
        chunk, slot = pending.popleft()
        events[slot].synchronize()
        buffer = ring.buffers[slot]
        for p, at in offsets(chunk):
            targets[p.item][p.start:p.stop].copy_(buffer[at:at + p.stop - p.start])

    for i, chunk in enumerate(plan):
        slot = i % len(ring.buffers)
        if len(pending) == len(ring.buffers):
            drain()  # the oldest chunk is the one in this slot
        buffer = ring.buffers[slot]
        with torch.cuda.stream(side):
            for p, at in offsets(chunk):
                buffer[at:at + p.stop - p.start].copy_(sources[p.item][p.start:p.stop],
                                                       non_blocking=True)
        events[slot].record(side)
        pending.append((chunk, slot))
    while pending:
        drain()


def _to_device(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
               plan: list[list[Piece]], ring: PinnedRing, side: torch.cuda.Stream) -> None:
    """Pageable `sources` -> buffer on the host once its last copy left; buffer -> device on
    `side`."""
    events = [torch.cuda.Event() for _ in ring.buffers]
    for i, chunk in enumerate(plan):
        slot = i % len(ring.buffers)
        if i >= len(ring.buffers):
            events[slot].synchronize()
        buffer = ring.buffers[slot]
        placed = offsets(chunk)
        for p, at in placed:
            buffer[at:at + p.stop - p.start].copy_(sources[p.item][p.start:p.stop])
        with torch.cuda.stream(side):
            for p, at in placed:
                targets[p.item][p.start:p.stop].copy_(buffer[at:at + p.stop - p.start],
                                                      non_blocking=True)
        events[slot].record(side)
