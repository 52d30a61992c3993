"""Multi-level data cache: local disk (fsspec) and a sharded in-memory key-value level.

`CachedDataset(source, decode, cache_dir=..., cache_bytes=..., comm=None)` reads sample files
from any fsspec source through level 1 (raw files on local disk, LRU under a byte cap) and
level 2 (decoded samples in memory, each replica of a gang holding the 1/N it owns), with a
collective exchange per step (`exchange`) and reads run ahead of compute (`batches`,
`prefetch`). Counters per level are in ``dataset.stats``.
"""

from .dataset import CachedDataset
from .disk import DiskCache
from .exchange import Exchanged, exchange
from .loader import ReplicaLoader
from .memory import MemoryStore, sample_nbytes
from .stats import CacheStats, LevelStats

__all__ = [
    "CacheStats",
    "CachedDataset",
    "DiskCache",
    "Exchanged",
    "LevelStats",
    "MemoryStore",
    "ReplicaLoader",
    "exchange",
    "sample_nbytes",
]
