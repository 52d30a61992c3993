"""One device's arena: a single byte tensor carved up by a ``BinAllocator``."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from .bins import AllocatorStats, BinAllocator

ALIGNMENT = 256
"""Bytes; every chunk starts on this boundary, so a view of any dtype is aligned."""


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class Arena:
    """One big ``uint8`` tensor per device; a ``BinAllocator`` over its byte offsets.

    Tensors placed here are typed views of the arena's storage, so the daemon owns their memory
    and the allocator's counters are the device's real usage. A view shares the whole arena
    storage: clone it before pickling or ``torch.save`` (they would write the entire arena).
    The methods are thread-safe (lanes allocate concurrently); ``allocator`` itself is not, so
    call it directly only for reads.
    """

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu") -> None:
        """Allocate ``capacity_bytes`` (rounded down to 256 bytes) on ``device`` at once."""
        if capacity_bytes < ALIGNMENT:
            raise ValueError(
                f"arena capacity must be at least {ALIGNMENT} bytes, got {capacity_bytes}")
        capacity = capacity_bytes - capacity_bytes % ALIGNMENT
        self._buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.device: torch.device = self._buffer.device
        self.capacity: int = capacity
        self.allocator = BinAllocator(capacity, alignment=ALIGNMENT, min_bin_bytes=ALIGNMENT)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int:
        """Reserve ``nbytes`` bytes; return the byte offset. Raises ``OutOfArenaMemory``."""
        with self._lock:
            return self.allocator.allocate(nbytes)

    def free(self, offset: int) -> None:
        """Release the chunk at byte ``offset``; views of it must no longer be used."""
        with self._lock:
            self.allocator.free(offset)

    def view(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``shape`` over the chunk that starts at ``offset``.

        The tensor aliases the arena storage (bytes ``offset`` onwards) but is not an autograd
        view of the arena: it has its own version counter.
        """
        shape = tuple(shape)
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"shape must be non-negative integers, got {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        held = self.size_of(offset)
        if nbytes > held:
            raise ValueError(f"a {dtype} tensor of shape {shape} needs {nbytes} bytes; "
                             f"the chunk at offset {offset} holds {held}")
        # set_ (not slicing) gives each view its own autograd version counter: slices would
        # share the arena's, so an in-place update of one tensor would invalidate every other.
        return torch.empty(0, dtype=dtype, device=self.device).set_(
            self._buffer.untyped_storage(), offset // dtype.itemsize, shape,
            _contiguous_strides(shape))

    def alloc_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """Allocate and return ``(offset, view)``; an empty tensor still takes one chunk."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = self.alloc(max(nbytes, 1))
        try:
            return offset, self.view(offset, shape, dtype)
        except ValueError:
            self.free(offset)
            raise

    def size_of(self, offset: int) -> int:
        """Bytes held by the chunk at ``offset`` (the aligned size)."""
        with self._lock:
            return self.allocator.size_of(offset)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this arena's storage."""
        return (tensor.device == self.device
                and tensor.untyped_storage().data_ptr() == self._buffer.data_ptr())

    def stats(self) -> AllocatorStats:
        """The allocator's counters, in bytes."""
        with self._lock:
            return self.allocator.stats()
