"""Device memory: the bin allocator, the per-device arena and jobs' resident state."""

from .arena import Arena
from .bins import AllocatorStats, BinAllocator, OutOfArenaMemory
from .residency import ResidentState

__all__ = ["AllocatorStats", "Arena", "BinAllocator", "OutOfArenaMemory", "ResidentState"]
