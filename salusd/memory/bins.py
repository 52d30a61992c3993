"""Best-fit-with-coalescing allocator over byte offsets (the TensorFlow BFC design).

The address space ``[0, capacity)`` is tiled by *chunks*, each either in use or free. Free chunks
sit in power-of-two size *bins*; bin ``i`` holds sizes in ``[min_bin << i, min_bin << (i + 1))``
(the last bin is open-ended). Every bin is a list of ``(size, offset)`` kept sorted with
``bisect``, and a bit mask marks the non-empty bins, so the best fit (smallest size, then lowest
offset) is one binary search in the request's bin or the head of the next non-empty bin. A chunk
larger than the request is split and the remainder goes back to its bin; a freed chunk merges
with free neighbours, so two free chunks are never adjacent.

No library offers this (``sortedcontainers`` is not a dependency and the standard ``heapq``
cannot remove an arbitrary chunk), hence the hand-written sorted bins.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from dataclasses import dataclass


class OutOfArenaMemory(MemoryError):
    """No single free chunk can hold the request (sizes in bytes)."""

    def __init__(self, requested: int, rounded: int, largest_free: int, free: int) -> None:
        self.requested = requested
        self.rounded = rounded
        self.largest_free = largest_free
        self.free = free
        super().__init__(
            f"cannot allocate {requested:,} bytes ({rounded:,} after alignment): the largest free "
            f"chunk is {largest_free:,} bytes and {free:,} bytes are free in total"
        )


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the allocator's exact counters; every size is in bytes.

    ``num_allocations`` counts live allocations (chunks in use), ``num_free_chunks`` the free
    chunks, ``peak`` the largest ``used`` seen since the allocator was made.
    """

    capacity: int
    used: int
    peak: int
    largest_free: int
    free: int
    num_allocations: int
    num_free_chunks: int

    @property
    def fragmentation(self) -> float:
        """Share of free bytes outside the largest free chunk: ``1 - largest_free / free``."""
        if self.free == 0:
            return 0.0
        return 1.0 - self.largest_free / self.free


@dataclass(slots=True)
class _Chunk:
    offset: int
    size: int
    in_use: bool
    prev: int | None
    next: int | None


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class BinAllocator:
    """Hands out aligned byte ranges of ``[0, capacity)``; sizes and offsets are in bytes."""

    def __init__(self, capacity: int, alignment: int = 256, min_bin_bytes: int = 256) -> None:
        capacity = operator.index(capacity)
        if not _is_power_of_two(alignment):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if not _is_power_of_two(min_bin_bytes):
            raise ValueError(f"min_bin_bytes must be a power of two, got {min_bin_bytes}")
        if capacity <= 0 or capacity % alignment:
            raise ValueError(
                f"capacity must be a positive multiple of the {alignment}-byte alignment, "
                f"got {capacity}"
            )
        self.capacity = capacity
        self.alignment = alignment
        self.min_bin_bytes = min_bin_bytes
        self._num_bins = self._raw_bin(capacity) + 1
        self._bins: list[list[tuple[int, int]]] = [[] for _ in range(self._num_bins)]
        self._nonempty = 0  # bit i set <=> bin i holds a free chunk
        self._chunks: dict[int, _Chunk] = {0: _Chunk(0, capacity, False, None, None)}
        self._used = 0
        self._peak = 0
        self._num_allocations = 0
        self._num_free_chunks = 0
        self._insert_free(self._chunks[0])

    def _raw_bin(self, size: int) -> int:
        return max(0, (size // self.min_bin_bytes).bit_length() - 1)

    def _bin_index(self, size: int) -> int:
        return min(self._num_bins - 1, self._raw_bin(size))

    def _insert_free(self, chunk: _Chunk) -> None:
        index = self._bin_index(chunk.size)
        insort(self._bins[index], (chunk.size, chunk.offset))
        self._nonempty |= 1 << index
        self._num_free_chunks += 1

    def _remove_free(self, chunk: _Chunk) -> None:
        index = self._bin_index(chunk.size)
        bin_ = self._bins[index]
        del bin_[bisect_left(bin_, (chunk.size, chunk.offset))]
        if not bin_:
            self._nonempty &= ~(1 << index)
        self._num_free_chunks -= 1

    def _best_fit(self, size: int) -> _Chunk | None:
        first = self._bin_index(size)
        # Only the request's own bin can hold chunks smaller than the request.
        bin_ = self._bins[first]
        i = bisect_left(bin_, (size, -1))
        if i < len(bin_):
            return self._chunks[bin_[i][1]]
        above = self._nonempty >> (first + 1)
        if not above:
            return None
        index = first + (above & -above).bit_length()  # lowest non-empty bin above `first`
        return self._chunks[self._bins[index][0][1]]

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (rounded up to the alignment) and return the chunk's byte offset."""
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"allocation size must be a positive number of bytes, got {nbytes}")
        rounded = -(-nbytes // self.alignment) * self.alignment
        chunk = self._best_fit(rounded)
        if chunk is None:
            free = self.capacity - self._used
            raise OutOfArenaMemory(nbytes, rounded, self._largest_free(), free)
        self._remove_free(chunk)
        if chunk.size > rounded:
            rest = _Chunk(chunk.offset + rounded, chunk.size - rounded, False, chunk.offset,
                          chunk.next)
            if chunk.next is not None:
                self._chunks[chunk.next].prev = rest.offset
            self._chunks[rest.offset] = rest
            chunk.next = rest.offset
            chunk.size = rounded
            self._insert_free(rest)
        chunk.in_use = True
        self._used += rounded
        self._peak = max(self._peak, self._used)
        self._num_allocations += 1
        return chunk.offset

    def _live_chunk(self, offset: int) -> _Chunk:
        chunk = self._chunks.get(offset)
        if chunk is None or not chunk.in_use:
            raise ValueError(f"offset {offset} is not the start of a live allocation "
                             "(never allocated, or already freed)")
        return chunk

    def _merge_next(self, chunk: _Chunk) -> None:
        assert chunk.next is not None
        nxt = self._chunks.pop(chunk.next)
        chunk.size += nxt.size
        chunk.next = nxt.next
        if nxt.next is not None:
            self._chunks[nxt.next].prev = chunk.offset

    def free(self, offset: int) -> None:
        """Release the allocation starting at byte ``offset`` and merge it with free neighbours."""
        chunk = self._live_chunk(offset)
        chunk.in_use = False
        self._used -= chunk.size
        self._num_allocations -= 1
        if chunk.next is not None and not self._chunks[chunk.next].in_use:
            self._remove_free(self._chunks[chunk.next])
            self._merge_next(chunk)
        if chunk.prev is not None and not self._chunks[chunk.prev].in_use:
            prev = self._chunks[chunk.prev]
            self._remove_free(prev)
            self._merge_next(prev)
            chunk = prev
        self._insert_free(chunk)

    def size_of(self, offset: int) -> int:
        """Bytes held by the live allocation at ``offset`` (the aligned size)."""
        return self._live_chunk(offset).size

    def _largest_free(self) -> int:
        if not self._nonempty:
            return 0
        return self._bins[self._nonempty.bit_length() - 1][-1][0]

    def stats(self) -> AllocatorStats:
        """Exact counters, in bytes."""
        return AllocatorStats(
            capacity=self.capacity,
            used=self._used,
            peak=self._peak,
            largest_free=self._largest_free(),
            free=self.capacity - self._used,
            num_allocations=self._num_allocations,
            num_free_chunks=self._num_free_chunks,
        )

    def check_invariants(self) -> None:
        """Walk every chunk and bin; raise ``AssertionError`` naming the first broken rule."""
        expected_free: set[tuple[int, int]] = set()
        offset, prev, prev_free = 0, None, False
        used = allocations = 0
        seen = 0
        while offset < self.capacity:
            chunk = self._chunks.get(offset)
            assert chunk is not None, f"no chunk starts at {offset}: chunks do not tile the arena"
            assert chunk.offset == offset, f"chunk at {offset} records offset {chunk.offset}"
            assert chunk.size > 0 and chunk.size % self.alignment == 0, (
                f"chunk at {offset} has size {chunk.size}, not a positive aligned size")
            assert chunk.prev == prev, f"chunk at {offset} has prev {chunk.prev}, expected {prev}"
            end = offset + chunk.size
            expected_next = end if end < self.capacity else None
            assert chunk.next == expected_next, (
                f"chunk at {offset} has next {chunk.next}, expected {expected_next}")
            if chunk.in_use:
                used += chunk.size
                allocations += 1
            else:
                assert not prev_free, f"free chunks at {prev} and {offset} are adjacent"
                expected_free.add((chunk.size, offset))
            prev, prev_free, offset = offset, not chunk.in_use, end
            seen += 1
        assert offset == self.capacity, f"chunks end at {offset}, capacity is {self.capacity}"
        assert seen == len(self._chunks), (
            f"{len(self._chunks) - seen} chunks are not reachable from offset 0")
        binned: set[tuple[int, int]] = set()
        for index, bin_ in enumerate(self._bins):
            assert bin_ == sorted(bin_), f"bin {index} is not sorted"
            assert bool(bin_) == bool(self._nonempty >> index & 1), (
                f"non-empty mask disagrees with bin {index}")
            for size, start in bin_:
                assert self._bin_index(size) == index, f"chunk at {start} sits in wrong bin {index}"
                binned.add((size, start))
        assert binned == expected_free, (
            f"bins hold {sorted(binned ^ expected_free)} wrongly (missing or extra free chunks)")
        assert sum(len(b) for b in self._bins) == len(expected_free), "a free chunk is binned twice"
        assert used == self._used, f"used counter {self._used} != {used} bytes in use"
        assert allocations == self._num_allocations, (
            f"allocation counter {self._num_allocations} != {allocations} chunks in use")
        assert self._num_free_chunks == len(expected_free), (
            f"free-chunk counter {self._num_free_chunks} != {len(expected_free)}")
        assert self._peak >= self._used, f"peak {self._peak} below used {self._used}"
