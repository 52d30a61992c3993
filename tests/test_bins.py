"""BinAllocator: unit cases and a stateful property test against an interval model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from salus.daemon.memory.bins import AllocatorStats, BinAllocator, OutOfArenaMemory


def test_rounds_up_to_alignment_and_splits() -> None:
    alloc = BinAllocator(4096)
    a = alloc.allocate(1)
    b = alloc.allocate(257)
    assert (a, b) == (0, 256)
    assert alloc.size_of(a) == 256 and alloc.size_of(b) == 512
    stats = alloc.stats()
    assert stats.used == 768 and stats.free == 4096 - 768
    assert stats.largest_free == 4096 - 768 and stats.num_free_chunks == 1
    assert stats.num_allocations == 2
    alloc.check_invariants()


def test_free_coalesces_both_neighbours() -> None:
    alloc = BinAllocator(4096)
    a, b, c = (alloc.allocate(1024) for _ in range(3))
    alloc.free(a)
    alloc.free(c)
    assert alloc.stats().num_free_chunks == 2  # c merged with the tail
    alloc.free(b)
    stats = alloc.stats()
    assert stats.num_free_chunks == 1 and stats.largest_free == 4096 and stats.used == 0
    assert stats.peak == 3072
    alloc.check_invariants()


def test_best_fit_prefers_the_smallest_chunk_that_fits() -> None:
    alloc = BinAllocator(8192)
    big = alloc.allocate(2048)
    alloc.allocate(256)
    small = alloc.allocate(512)
    alloc.allocate(256)
    alloc.free(big)
    alloc.free(small)
    # Free chunks: 2048 at offset 0, 512 at 2304, the tail; 512 bytes fit the second best.
    assert alloc.allocate(300) == small
    assert alloc.allocate(1024) == big


def test_out_of_memory_reports_sizes_and_fragmentation() -> None:
    alloc = BinAllocator(2048)
    offsets = [alloc.allocate(256) for _ in range(8)]
    for offset in offsets[::2]:
        alloc.free(offset)
    stats = alloc.stats()
    assert stats.free == 1024 and stats.largest_free == 256
    assert stats.fragmentation == pytest.approx(0.75)
    with pytest.raises(OutOfArenaMemory) as err:
        alloc.allocate(300)
    assert (err.value.requested, err.value.rounded) == (300, 512)
    assert (err.value.largest_free, err.value.free) == (256, 1024)
    assert "300" in str(err.value) and "1,024" in str(err.value)
    assert isinstance(err.value, MemoryError)
    assert alloc.stats() == stats  # a failed allocation changes nothing


def test_whole_capacity_and_exhaustion() -> None:
    alloc = BinAllocator(1 << 20)
    offset = alloc.allocate(1 << 20)
    assert offset == 0
    assert alloc.stats() == AllocatorStats(1 << 20, 1 << 20, 1 << 20, 0, 0, 1, 0)
    assert alloc.stats().fragmentation == 0.0
    with pytest.raises(OutOfArenaMemory):
        alloc.allocate(1)
    alloc.free(offset)
    alloc.check_invariants()


@pytest.mark.parametrize("nbytes", [0, -5])
def test_rejects_non_positive_sizes(nbytes: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        BinAllocator(4096).allocate(nbytes)


def test_rejects_bad_frees() -> None:
    alloc = BinAllocator(4096)
    offset = alloc.allocate(512)
    with pytest.raises(ValueError, match="not the start of a live allocation"):
        alloc.free(256)  # inside the chunk
    with pytest.raises(ValueError, match="not the start of a live allocation"):
        alloc.free(512)  # the free remainder
    alloc.free(offset)
    with pytest.raises(ValueError, match="already freed"):
        alloc.free(offset)
    with pytest.raises(ValueError):
        alloc.size_of(offset)


@pytest.mark.parametrize(("capacity", "alignment", "min_bin"),
                         [(0, 256, 256), (1000, 256, 256), (4096, 100, 256), (4096, 256, 300)])
def test_rejects_bad_configuration(capacity: int, alignment: int, min_bin: int) -> None:
    with pytest.raises(ValueError):
        BinAllocator(capacity, alignment=alignment, min_bin_bytes=min_bin)


def test_rejects_non_integer_sizes() -> None:
    with pytest.raises(TypeError):
        BinAllocator(4096).allocate(1.5)


def _free_gaps(capacity: int, live: dict[int, int]) -> list[tuple[int, int]]:
    """Maximal free intervals as (size, start), from the live allocations alone."""
    gaps, cursor = [], 0
    for start in sorted(live):
        if start > cursor:
            gaps.append((start - cursor, cursor))
        cursor = start + live[start]
    if cursor < capacity:
        gaps.append((capacity - cursor, cursor))
    return gaps


class AllocatorMachine(RuleBasedStateMachine):
    """Drives random allocate/free sequences; the model is the set of live intervals."""

    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BinAllocator(256)
        self.live: dict[int, int] = {}
        self.max_used = 0

    @initialize(units=st.integers(1, 300), alignment=st.sampled_from([16, 256]),
                min_bin=st.sampled_from([256, 1024]))
    def setup(self, units: int, alignment: int, min_bin: int) -> None:
        self.alloc = BinAllocator(units * alignment, alignment=alignment, min_bin_bytes=min_bin)

    @rule(target=allocations, data=st.data())
    def allocate(self, data: st.DataObject) -> int:
        capacity, alignment = self.alloc.capacity, self.alloc.alignment
        # Mostly small requests so the arena fills up; sometimes one as big as it.
        limit = data.draw(st.sampled_from([capacity // 8 + 1, capacity + alignment]))
        nbytes = data.draw(st.integers(1, limit), label="nbytes")
        rounded = -(-nbytes // alignment) * alignment
        fitting = [g for g in _free_gaps(capacity, self.live) if g[0] >= rounded]
        if not fitting:
            with pytest.raises(OutOfArenaMemory):
                self.alloc.allocate(nbytes)
            return -1
        offset = self.alloc.allocate(nbytes)
        assert offset == min(fitting)[1], "not the best fit (smallest gap, then lowest offset)"
        assert offset % alignment == 0 and self.alloc.size_of(offset) == rounded
        self.live[offset] = rounded
        self.max_used = max(self.max_used, sum(self.live.values()))
        return offset

    @rule(offset=consumes(allocations))
    def free(self, offset: int) -> None:
        if offset not in self.live:  # a failed allocation, or already freed by free_all
            return
        self.alloc.free(offset)
        del self.live[offset]

    @rule()
    def free_all(self) -> None:
        for offset in list(self.live):
            self.alloc.free(offset)
        self.live.clear()
        stats = self.alloc.stats()
        assert stats.num_free_chunks == 1 and stats.largest_free == self.alloc.capacity
        assert stats.used == 0 and stats.fragmentation == 0.0

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        stats = self.alloc.stats()
        intervals = sorted(self.live.items())
        for (a, size), (b, _) in zip(intervals, intervals[1:], strict=False):
            assert a + size <= b, f"allocations at {a} and {b} overlap"
        assert stats.used == sum(self.live.values())
        assert stats.peak == self.max_used
        assert stats.num_allocations == len(self.live)
        gaps = _free_gaps(self.alloc.capacity, self.live)
        assert stats.num_free_chunks == len(gaps)
        assert stats.largest_free == max((g[0] for g in gaps), default=0)


AllocatorMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
