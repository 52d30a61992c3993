"""Level 1: raw sample files copied to a local directory, capped in bytes, evicted LRU.

A file is stored under the SHA-256 of its source URL, written to a temporary name and renamed,
so a reader never sees half a file. The index (name, size, recency) lives in memory; at start
the files already in the directory are adopted, oldest modification first, so a restarted job
finds its cache warm. A file larger than the whole cap is served but not kept.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

from .stats import LevelStats

_NAME_LEN = 64  # hex digits of SHA-256


def cache_name(url: str) -> str:
    """The file name a source URL is cached under."""
    return hashlib.sha256(url.encode()).hexdigest()


class DiskCache:
    """At most ``capacity_bytes`` bytes of files in ``directory``, least recently used first out.

    Thread-safe. ``stats`` is updated in place (hits, misses, bytes served, bytes held,
    evictions).
    """

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 stats: LevelStats) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 bytes, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> bytes, LRU first
        self._adopt()

    def _adopt(self) -> None:
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # left by a writer that died mid-write
            elif len(path.name) == _NAME_LEN and path.is_file():
                st = path.stat()
                found.append((st.st_mtime, path.name, st.st_size))
        with self._lock:
            for _mtime, name, size in sorted(found):
                self._entries[name] = size
                self.stats.stored_bytes += size
            self._evict(0)

    def get(self, url: str) -> bytes | None:
        """The cached bytes of ``url``, or None on a miss (counted either way)."""
        name = cache_name(url)
        with self._lock:
            known = name in self._entries
            if known:
                self._entries.move_to_end(name)
        data = None
        if known:
            try:
                data = (self.directory / name).read_bytes()
            except FileNotFoundError:  # removed behind our back: forget it
                with self._lock:
                    self.stats.stored_bytes -= self._entries.pop(name, 0)
        with self._lock:
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.hit_bytes += len(data)
        return data

    def put(self, url: str, data: bytes) -> None:
        """Keep ``data`` as ``url``'s file, evicting least recently used files to make room."""
        size = len(data)
        if size > self.capacity_bytes:
            return
        name = cache_name(url)
        with self._lock:
            if name in self._entries:
                return
            self._evict(size)
            tmp = self.directory / f"{name}.{threading.get_ident()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.directory / name)
            self._entries[name] = size
            self.stats.stored_bytes += size

    def _evict(self, incoming: int) -> None:
        while self._entries and self.stats.stored_bytes + incoming > self.capacity_bytes:
            name, size = self._entries.popitem(last=False)
            (self.directory / name).unlink(missing_ok=True)
            self.stats.stored_bytes -= size
            self.stats.evictions += 1

    def names(self) -> list[str]:
        """Cached file names, least recently used first."""
        with self._lock:
            return list(self._entries)
