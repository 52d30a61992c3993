"""Counters of the data cache: hits, misses and bytes per level, the source, the exchange."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field


@dataclass
class LevelStats:
    """One cache level. ``hit_bytes``: bytes served from the level; ``stored_bytes``: bytes it
    holds now; ``evictions``: entries dropped to stay under its cap."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    stored_bytes: int = 0
    evictions: int = 0


@dataclass
class CacheStats:
    """Every counter of one `CachedDataset` on this rank.

    ``memory``: level 2 (decoded samples this rank owns); ``disk``: level 1 (raw files).
    ``source_*``: reads that reached the source, their bytes and seconds. ``exchange_*``:
    bytes this rank sent to and received from the other replicas. ``read_seconds``: time the
    run-ahead thread spent producing batches; ``wait_seconds``: time the consumer waited for
    them, so ``1 - wait_seconds / read_seconds`` is the share of read time hidden behind
    compute.
    """

    memory: LevelStats = field(default_factory=LevelStats)
    disk: LevelStats = field(default_factory=LevelStats)
    source_reads: int = 0
    source_bytes: int = 0
    source_seconds: float = 0.0
    exchange_sent_bytes: int = 0
    exchange_received_bytes: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> dict[str, object]:
        """A JSON-ready copy of the counters."""
        with self.lock:
            return {
                "memory": asdict(self.memory),
                "disk": asdict(self.disk),
                "source_reads": self.source_reads,
                "source_bytes": self.source_bytes,
                "source_seconds": self.source_seconds,
                "exchange_sent_bytes": self.exchange_sent_bytes,
                "exchange_received_bytes": self.exchange_received_bytes,
                "read_seconds": self.read_seconds,
                "wait_seconds": self.wait_seconds,
            }

