"""Placement: where each admitted job's persistent state and each lane sit in a device's budget.

Per device a `BinAllocator` (BFC-style) lays out regions of the device's budget: one per job for
its persistent state, one per lane for ephemeral memory. The bytes themselves are allocated by
the job's executor (its own process memory on the CPU, its own CUDA allocations on a GPU), so an
offset here names a share of the budget, not an address, and re-laying the regions out moves no
byte. That is how every admitted job can always be placed: admission books exactly the aligned
sizes placed here, so whenever the scheduler admits a job the free bytes suffice, and if they
are split into pieces too small, `place` compacts the layout first (`compactions` counts it).
"""

from __future__ import annotations

from collections.abc import Hashable

from salus.daemon.memory.bins import AllocatorStats, BinAllocator, OutOfArenaMemory

ALIGNMENT = 256
"""Bytes; sizes the scheduler books are rounded up to this, as the allocator rounds them."""

RegionKey = tuple[str, Hashable]


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the ledger's granularity (at least one unit)."""
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


class DeviceLedger:
    """The regions of one device's budget of `capacity` bytes (rounded down to ALIGNMENT)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGNMENT
        self.allocator = BinAllocator(self.capacity, alignment=ALIGNMENT,
                                      min_bin_bytes=ALIGNMENT)
        # key -> (offset, bytes): the offset frees the region and orders a compaction
        self.regions: dict[RegionKey, tuple[int, int]] = {}
        self.compactions = 0

    def place(self, key: RegionKey, nbytes: int) -> None:
        """Place region `key` of `nbytes` bytes (replacing one of that key). Raises
        OutOfArenaMemory only when the free bytes in all do not suffice."""
        self.remove(key)
        try:
            offset = self.allocator.allocate(nbytes)
        except OutOfArenaMemory as exc:
            if exc.free < exc.rounded:
                raise
            self._compact()
            offset = self.allocator.allocate(nbytes)
        self.regions[key] = (offset, nbytes)

    def remove(self, key: RegionKey) -> None:
        region = self.regions.pop(key, None)
        if region is not None:
            self.allocator.free(region[0])

    def size(self, key: RegionKey) -> int | None:
        region = self.regions.get(key)
        return None if region is None else region[1]

    def stats(self) -> AllocatorStats:
        return self.allocator.stats()

    def _compact(self) -> None:
        """Lay every region out again from offset 0, in their current order."""
        self.compactions += 1
        fresh = BinAllocator(self.capacity, alignment=ALIGNMENT, min_bin_bytes=ALIGNMENT)
        order = sorted(self.regions.items(), key=lambda item: item[1][0])
        self.regions = {key: (fresh.allocate(size), size) for key, (_, size) in order}
        self.allocator = fresh

    def check_invariants(self) -> None:
        """The allocator's own invariants, and its use equal to the regions' aligned sizes."""
        self.allocator.check_invariants()
        used = sum(aligned(size) for _, size in self.regions.values())
        assert self.allocator.stats().used == used, (self.allocator.stats().used, used)
