"""BinAllocator vs a first-fit free list: allocate/free throughput and fragmentation.

Both allocators replay the same random workload (log-uniform sizes from 256 bytes to 1 MiB, a
target number of live allocations, frees of random live allocations) in the same process, so
the figures are ratios measured side by side. Prints one JSON object on stdout.

    .venv/bin/python bench/allocator.py [--quick]
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
from typing import Protocol

from salus.daemon.memory.bins import BinAllocator, OutOfArenaMemory

ALIGNMENT = 256


class FirstFit:
    """The baseline: a sorted list of free ranges scanned front to back, merged on free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_ranges: list[list[int]] = [[0, capacity]]  # [offset, size], sorted by offset
        self.sizes: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int:
        rounded = -(-nbytes // ALIGNMENT) * ALIGNMENT
        for i, (offset, size) in enumerate(self.free_ranges):
            if size >= rounded:
                if size == rounded:
                    del self.free_ranges[i]
                else:
                    self.free_ranges[i] = [offset + rounded, size - rounded]
                self.sizes[offset] = rounded
                return offset
        raise OutOfArenaMemory(nbytes, rounded, self.largest_free(), self.free_bytes())

    def free(self, offset: int) -> None:
        size = self.sizes.pop(offset)
        i = bisect.bisect_left(self.free_ranges, [offset, 0])
        self.free_ranges.insert(i, [offset, size])
        if i + 1 < len(self.free_ranges) and offset + size == self.free_ranges[i + 1][0]:
            self.free_ranges[i][1] += self.free_ranges.pop(i + 1)[1]
        if i > 0 and self.free_ranges[i - 1][0] + self.free_ranges[i - 1][1] == offset:
            self.free_ranges[i - 1][1] += self.free_ranges.pop(i)[1]

    def largest_free(self) -> int:
        return max((size for _, size in self.free_ranges), default=0)

    def free_bytes(self) -> int:
        return self.capacity - sum(self.sizes.values())


class Allocator(Protocol):
    def allocate(self, nbytes: int) -> int: ...
    def free(self, offset: int) -> None: ...


def workload(ops: int, live_target: int, seed: int) -> list[tuple[bool, int]]:
    """(is_alloc, size or a random pick) pairs; allocations dominate until live_target."""
    rng = random.Random(seed)
    plan, live = [], 0
    for _ in range(ops):
        grow = live < live_target * 0.9 or (live < live_target * 1.1 and rng.random() < 0.5)
        if grow:
            plan.append((True, int(2 ** rng.uniform(8, 20))))
            live += 1
        else:
            plan.append((False, rng.randrange(1 << 30)))
            live -= 1
    return plan


def replay(allocator: Allocator, plan: list[tuple[bool, int]]) -> tuple[float, int]:
    """Seconds spent and failed allocations; frees pick a live allocation by swap-remove."""
    live: list[int] = []
    failures = 0
    start = time.perf_counter()
    for is_alloc, value in plan:
        if is_alloc:
            try:
                live.append(allocator.allocate(value))
            except OutOfArenaMemory:
                failures += 1
        elif live:
            i = value % len(live)
            live[i], live[-1] = live[-1], live[i]
            allocator.free(live.pop())
    return time.perf_counter() - start, failures


def fragmentation(largest_free: int, free: int) -> float:
    return 0.0 if free == 0 else 1.0 - largest_free / free


def run(live_target: int, ops: int, capacity: int) -> dict[str, float | int]:
    plan = workload(ops, live_target, seed=live_target)
    bins, naive = BinAllocator(capacity), FirstFit(capacity)
    bins_s, bins_fail = replay(bins, plan)
    naive_s, naive_fail = replay(naive, plan)
    stats = bins.stats()
    result: dict[str, float | int] = {
        "live_allocations": live_target,
        "ops": ops,
        "bins_ops_per_s": round(ops / bins_s),
        "first_fit_ops_per_s": round(ops / naive_s),
        "speedup_vs_first_fit": round(naive_s / bins_s, 2),
        "bins_fragmentation": round(stats.fragmentation, 4),
        "first_fit_fragmentation": round(
            fragmentation(naive.largest_free(), naive.free_bytes()), 4),
        "bins_failed_allocations": bins_fail,
        "first_fit_failed_allocations": naive_fail,
        "bins_used_fraction": round(stats.used / capacity, 4),
    }
    print(f"live={live_target}: {result}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload (seconds)")
    args = parser.parse_args()
    ops = 20_000 if args.quick else 200_000
    targets = [100, 1_000, 4_000] if args.quick else [100, 1_000, 10_000]
    results = []
    for live in targets:
        # Room for about 1.3x the live set's mean size (~190 KB): full enough to fragment.
        capacity = -(-int(live * 190_000 * 1.3) // ALIGNMENT) * ALIGNMENT
        results.append(run(live, ops, capacity))
    print(json.dumps({"benchmark": "allocator", "quick": args.quick, "workloads": results}))


if __name__ == "__main__":
    main()
