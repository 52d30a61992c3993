"""What torch's CUDA caching allocator reserves for a sequence of allocations (bytes).

`torch.cuda.set_per_process_memory_fraction` is checked against the allocator's *reserved*
bytes plus the whole segment it is about to create, not against tensor bytes, so a CUDA
device's ledger books in these units. This module models the allocator without importing
torch. It follows ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch at commit
eb42ad6eca0ce61e7c581212b4bf32f991425571) with its default configuration (no
``PYTORCH_CUDA_ALLOC_CONF``: no expandable segments, no ``max_split_size_mb``, no power-of-two
rounding), one stream:

- ``kMinBlockSize`` = 512, ``kSmallSize`` = 1 MiB, ``kSmallBuffer`` = 2 MiB,
  ``kMinLargeAlloc`` = 10 MiB, ``kRoundLarge`` = 2 MiB, ``kLargeBuffer`` = 20 MiB (the constants
  at the top of the file).
- ``round_size``: a request is rounded up to a multiple of 512 bytes (at least 512).
- ``get_pool``: a rounded request of at most ``kSmallSize`` is served from the small pool,
  anything larger from the large pool; a pool never serves the other's requests.
- ``get_allocation_size``: a new segment is ``kSmallBuffer`` for a small request,
  ``kLargeBuffer`` for one under ``kMinLargeAlloc``, else the request rounded up to
  ``kRoundLarge``.
- ``get_free_block``: best fit among the pool's cached free blocks (``BlockComparatorSize``:
  smallest size, then lowest address); only when none fits does ``alloc_block`` create a
  segment (``malloc``).
- ``should_split`` / ``alloc_found_block``: the block is split when the rest is at least
  ``kMinBlockSize`` (small pool) or more than ``kSmallSize`` (large pool); the rest stays cached.
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment and stays cached; reserved bytes shrink only with ``empty_cache`` or when an
  allocation would fail, which this model leaves out, so its peak is an upper bound of what a
  capped process needs.

And the cuBLAS workspaces (``aten/src/ATen/cuda/CublasHandlePool.cpp`` at pytorch/pytorch
commit 26a39059ec580351411f180816c47e2ef5134ae1): the first GEMM on a (handle, stream) takes a
workspace of ``getChosenWorkspaceSize()`` from the caching allocator
(``parseChosenWorkspaceSize``: the sum of SIZE KiB × COUNT over the ``:SIZE:COUNT`` pairs of
``CUBLAS_WORKSPACE_CONFIG``; unset or unreadable, 4096 KiB × 8 on sm90, else
4096 KiB × 2 + 16 KiB × 8), and the first cuBLASLt matmul one of
``getCUDABlasLtWorkspaceSize()`` (``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024, at most the
cuBLAS workspace), a separate allocation unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``.
"""

from __future__ import annotations

import re
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small pool segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger segments are multiples of this

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""What salusd sets for executors whose environment has none: 8 × 4096 KiB = 32 MiB, torch's
sm90 default, so the size is the same on every GPU and known to the daemon."""


def round_size(nbytes: int) -> int:
    """The block size torch's allocator hands out for a request of `nbytes` bytes."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def is_small(nbytes: int) -> bool:
    """Whether a request of `nbytes` bytes is served from the small pool."""
    return round_size(nbytes) <= SMALL_SIZE


def segment_size(nbytes: int) -> int:
    """Bytes of the segment torch creates for a request of `nbytes` bytes that no cached block
    holds."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    """A piece of a segment: `offset` bytes into segment `segment`, `size` bytes."""

    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocatorModel:
    """The reserved and allocated bytes of torch's CUDA caching allocator (one device, one
    stream) as requests and frees arrive: `alloc(key, nbytes)`, `free(key)`."""

    def __init__(self) -> None:
        self.reserved = 0  # bytes of all segments
        self.allocated = 0  # bytes of the blocks in use (rounded, split as torch splits)
        self.peak_reserved = 0
        self.segments: list[int] = []  # each segment's bytes, in creation order
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._free_blocks: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[Hashable, _Block] = {}

    def alloc(self, key: Hashable, nbytes: int) -> None:
        """A request of `nbytes` bytes held under `key` (a key already held is freed first,
        after the new block is taken: a resize copies)."""
        old = self._live.pop(key, None)
        if nbytes > 0:  # torch allocates nothing for an empty storage
            self._take(key, nbytes)
        if old is not None:
            self._release(old)

    def free(self, key: Hashable) -> None:
        """The request held under `key` is freed (its block stays cached); an empty one held
        nothing."""
        block = self._live.pop(key, None)
        if block is not None:
            self._release(block)

    def _take(self, key: Hashable, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size) or self._new_segment(small, segment_size(size))
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            after = _Block(block.segment, block.offset + size, rest, small, True, block,
                           block.next)
            if block.next is not None:
                block.next.prev = after
            block.next, block.size = after, size
            self._cache(after)
        block.free = False
        self.allocated += block.size
        self._live[key] = block

    def _release(self, block: _Block) -> None:
        self.allocated -= block.size
        before, after = block.prev, block.next
        if before is not None and before.free:
            self._uncache(before)
            block.offset, block.size, block.prev = before.offset, before.size + block.size, \
                before.prev
            if block.prev is not None:
                block.prev.next = block
        if after is not None and after.free:
            self._uncache(after)
            block.size, block.next = block.size + after.size, after.next
            if block.next is not None:
                block.next.prev = block
        block.free = True
        self._cache(block)

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        keys = self._free[small]
        i = bisect_left(keys, (size, -1, -1))
        if i == len(keys):
            return None
        block = self._free_blocks[keys[i]]
        self._uncache(block)
        return block

    def _new_segment(self, small: bool, nbytes: int) -> _Block:
        self.segments.append(nbytes)
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(len(self.segments) - 1, 0, nbytes, small)

    def _cache(self, block: _Block) -> None:
        insort(self._free[block.small], block.key())
        self._free_blocks[block.key()] = block

    def _uncache(self, block: _Block) -> None:
        keys = self._free[block.small]
        del keys[bisect_left(keys, block.key())]
        del self._free_blocks[block.key()]

    def check_invariants(self) -> None:
        """Every segment is tiled by its blocks; the counters match the blocks."""
        blocks = [*self._live.values(), *self._free_blocks.values()]
        assert len({id(b) for b in blocks}) == len(blocks), "a block both live and cached"
        for index, nbytes in enumerate(self.segments):
            mine = sorted((b for b in blocks if b.segment == index), key=lambda b: b.offset)
            assert mine and mine[0].offset == 0 and mine[0].prev is None, index
            for a, b in zip(mine, mine[1:], strict=False):
                assert a.offset + a.size == b.offset and a.next is b and b.prev is a, index
                assert not (a.free and b.free), f"two free neighbours in segment {index}"
            assert mine[-1].offset + mine[-1].size == nbytes and mine[-1].next is None, index
        assert self.reserved == sum(self.segments) <= self.peak_reserved
        assert self.allocated == sum(b.size for b in self._live.values())


def reserved_for(sizes: Iterable[int]) -> int:
    """Reserved bytes for tensors of `sizes` bytes allocated in that order and held together
    (a job's persistent state)."""
    model = CachingAllocatorModel()
    for i, nbytes in enumerate(sizes):
        model.alloc(i, nbytes)
    return model.reserved


def peak_reserved(events: Iterable[tuple[Hashable, int]]) -> int:
    """Peak reserved bytes over `events` in order, each ``(key, nbytes)``: the storage `key`
    now holds `nbytes` bytes (allocated, or resized), or is freed (``nbytes == 0``)."""
    model = CachingAllocatorModel()
    for key, nbytes in events:
        if nbytes > 0:
            model.alloc(key, nbytes)
        else:
            model.free(key)
    return model.peak_reserved


_PAIR = re.compile(r":([0-9]+):([0-9]+)")
_SM90_DEFAULT = 4096 * KIB * 8
_OTHER_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8


def cublas_workspace_bytes(config: str | None, sm90: bool | None = None) -> int:
    """Bytes of the cuBLAS workspace torch takes per (handle, stream) under
    ``CUBLAS_WORKSPACE_CONFIG`` = `config` (None: unset). Where the config does not say, the
    default depends on the GPU: sm90 or not (None: unknown, the larger of the two)."""
    pairs = _PAIR.findall(config or "")
    if pairs:
        return sum(int(size) * KIB * int(count) for size, count in pairs)
    if sm90 is None:
        return max(_SM90_DEFAULT, _OTHER_DEFAULT)
    return _SM90_DEFAULT if sm90 else _OTHER_DEFAULT


def cublaslt_workspace_bytes(size_kib: str | None, cublas_bytes: int) -> int:
    """Bytes of the cuBLASLt workspace under ``CUBLASLT_WORKSPACE_SIZE`` = `size_kib` (KiB;
    None or unreadable: 1024), capped at the cuBLAS workspace's `cublas_bytes`."""
    match = re.match(r"\s*[+-]?[0-9]+", size_kib or "")  # std::stoi reads a leading integer
    kib = int(match.group()) if match else 1024
    return min(max(0, kib) * KIB, cublas_bytes)


def blas_workspace_reserved(env: Mapping[str, str], sm90: bool | None = None) -> int:
    """Reserved bytes the cuBLAS and cuBLASLt workspaces of one (handle, stream) take in a
    process whose environment is `env`, each in its own allocator segment."""
    cublas = cublas_workspace_bytes(env.get("CUBLAS_WORKSPACE_CONFIG"), sm90)
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return reserved_for([cublas])
    lt = cublaslt_workspace_bytes(env.get("CUBLASLT_WORKSPACE_SIZE"), cublas)
    return reserved_for([cublas]) + reserved_for([lt])
