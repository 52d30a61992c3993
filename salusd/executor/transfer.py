"""Copying a job's storages between host and device memory, in bounded chunks.

Between the CPU and a CUDA device the bytes go through pinned host memory: a swap-out copies
each device storage into a pinned host buffer, a swap-in copies it back, both with
`non_blocking=True` on a side stream of the CUDA device, in chunks of at most `CHUNK_BYTES`,
and with one synchronisation at the end. The side stream first waits for the job's stream, so
the state's last writes are copied; destinations are allocated on the job's stream, where they
will be used (the caching allocator reuses a block only on the stream that allocated it).
Anything else (CPU to CPU, one GPU to another) is one `Tensor.to` per storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_BYTES = 64 * 2**20


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


def copy_storages(sources: Sequence[torch.Tensor], device: torch.device,
                  chunk_bytes: int = CHUNK_BYTES) -> list[torch.Tensor]:
    """Copies on `device` of `sources`: 1-D uint8 tensors on one device, each a whole storage.
    Between the CPU and a CUDA device, through pinned host memory in chunks (see the module's
    docstring); the copies are complete when this returns."""
    if not sources:
        return []
    source = sources[0].device
    if {source.type, device.type} != {"cpu", "cuda"}:
        return [s.to(device) for s in sources]
    gpu = device if device.type == "cuda" else source
    job_stream = torch.cuda.current_stream(gpu)
    side = torch.cuda.Stream(gpu)
    targets = [torch.empty(s.numel(), dtype=torch.uint8, device=device,
                           pin_memory=device.type == "cpu") for s in sources]
    side.wait_stream(job_stream)
    with torch.cuda.stream(side):
        for chunk in plan_chunks([s.numel() for s in sources], chunk_bytes):
            for piece in chunk:
                targets[piece.item][piece.start:piece.stop].copy_(
                    sources[piece.item][piece.start:piece.stop], non_blocking=True)
    side.synchronize()
    return targets
