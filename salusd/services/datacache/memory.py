"""Level 2: decoded samples in memory, keyed by sample index, optionally capped in bytes (LRU).

In a gang each replica keeps only the samples it owns (``index % N == rank``), so the gang
together holds the decoded data set once: 1/N of it per replica.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

import torch

from .stats import LevelStats

T = TypeVar("T")


def sample_nbytes(sample: object) -> int:
    """Bytes a decoded sample holds: tensor and array data, bytes, summed through containers
    (dict values, lists, tuples); other objects count ``sys.getsizeof``."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, bytes | bytearray):
        return len(sample)
    if isinstance(sample, dict):
        return sum(sample_nbytes(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(sample_nbytes(v) for v in sample)
    nbytes = getattr(sample, "nbytes", None)  # numpy arrays and the like
    return int(nbytes) if isinstance(nbytes, int) else sys.getsizeof(sample)


class MemoryStore(Generic[T]):
    """Decoded samples by index; ``capacity_bytes=None`` keeps every sample put, otherwise the
    least recently used go first once their bytes (`sample_nbytes`) would exceed the cap.

    Thread-safe; ``stats`` is updated in place.
    """

    def __init__(self, capacity_bytes: int | None, stats: LevelStats) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 bytes or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._lock = threading.Lock()
        self._items: OrderedDict[int, tuple[T, int]] = OrderedDict()

    def get(self, index: int) -> T | None:
        """The sample at ``index``, or None on a miss (counted either way)."""
        with self._lock:
            item = self._items.get(index)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(index)
            self.stats.hits += 1
            self.stats.hit_bytes += item[1]
            return item[0]

    def put(self, index: int, sample: T) -> None:
        """Keep ``sample`` at ``index`` (skipped when it alone exceeds the cap)."""
        size = sample_nbytes(sample)
        cap = self.capacity_bytes
        if cap is not None and size > cap:
            return
        with self._lock:
            old = self._items.pop(index, None)
            if old is not None:
                self.stats.stored_bytes -= old[1]
            while cap is not None and self._items and self.stats.stored_bytes + size > cap:
                _, (_, dropped) = self._items.popitem(last=False)
                self.stats.stored_bytes -= dropped
                self.stats.evictions += 1
            self._items[index] = (sample, size)
            self.stats.stored_bytes += size

    def indices(self) -> list[int]:
        """The indices held, in ascending order."""
        with self._lock:
            return sorted(self._items)
