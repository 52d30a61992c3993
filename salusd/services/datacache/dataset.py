"""`CachedDataset`: a data set of sample files read through two cache levels, shared by a gang.

Sample ``i`` is the ``i``-th file of the source (fsspec: a directory listed recursively and
sorted, or a list of file URLs). Reading it: level 2 (decoded samples in memory, on the rank
that owns ``i``), else level 1 (the raw file on local disk), else the source, whose bytes then
go to level 1 and, decoded, to level 2. With a `Comm`, ``get_batch`` is collective: the
replicas exchange what they own (`exchange`), so the gang reads each file from the source once
and holds each decoded sample once. ``batches`` runs those reads ahead of compute on a
background thread, a bounded queue apart.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import fsspec
import torch
import torch.distributed as dist
from fsspec import AbstractFileSystem

from .disk import DiskCache
from .exchange import exchange
from .memory import MemoryStore
from .stats import CacheStats

if TYPE_CHECKING:  # a Comm is the caller's: the collectives are imported by who makes one
    from salus.daemon.services.comm import Comm

T = TypeVar("T")
_DONE = object()


class CachedDataset(torch.utils.data.Dataset[T], Generic[T]):
    """Sample files from ``source``, decoded by ``decode(raw_bytes)``, behind two cache levels.

    ``cache_dir``: level 1's directory (a ``rank<r>`` folder in it per replica with a Comm);
    ``cache_bytes``: level 1's cap per replica, bytes. ``memory_bytes``: level 2's cap per
    replica, bytes (None: no cap, 0: no level 2). ``comm``: the gang's Comm; level 2 is then
    sharded (owner of ``i``: rank ``i % N``) and ``get_batch``/``batches`` are collective.
    ``storage_options`` go to fsspec (credentials, or options of a custom filesystem).

    ``dataset[i]`` reads one sample locally and never communicates (a non-owner does not keep
    it in level 2). Constructing it with a Comm is collective (a sub-group for the exchange,
    and a check that every rank lists the same files). With ``comm_later`` the gang's Comm is
    given afterwards (`bind`, then collective): a data set that a gang's entrypoint builds
    before its replica has joined the gang's group; it is not read before.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        decode: Callable[[bytes], T],
        *,
        cache_dir: str | os.PathLike[str],
        cache_bytes: int,
        comm: Comm | None = None,
        memory_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        comm_later: bool = False,
    ) -> None:
        self.decode = decode
        self.stats = CacheStats()
        self._files = _list_files(source, dict(storage_options or {}))
        self._cache_dir, self._cache_bytes = Path(cache_dir), cache_bytes
        self.rank, self.size = 0, 1
        self._disk: DiskCache
        self._memory: MemoryStore[T] = MemoryStore(memory_bytes, self.stats.memory)
        self._group: dist.ProcessGroup | None = None
        if not comm_later:
            self.bind(comm)
        self._collective = threading.Lock()
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salus-prefetch")

    def bind(self, comm: Comm | None) -> None:
        """Take the gang's `comm` (None: none; collective with one): level 1 in this replica's
        folder, level 2 sharded over the replicas."""
        self.rank, self.size = (0, 1) if comm is None else (comm.rank, comm.size)
        directory = self._cache_dir if comm is None else self._cache_dir / f"rank{comm.rank}"
        self._disk = DiskCache(directory, self._cache_bytes, self.stats.disk)
        if comm is not None:
            self._group = comm.new_group("gloo")
            _check_same_files(self._group, [url for _fs, _path, url in self._files])

    def __len__(self) -> int:
        return len(self._files)

    def url(self, index: int) -> str:
        """The source URL of sample ``index``."""
        return self._files[index][2]

    def owns(self, index: int) -> bool:
        """Whether this replica keeps sample ``index`` in level 2."""
        return index % self.size == self.rank

    def held(self) -> list[int]:
        """The sample indices in this replica's level 2, ascending."""
        return self._memory.indices()

    def __getitem__(self, index: int) -> T:
        if not 0 <= index < len(self._files):
            raise IndexError(f"sample index {index} outside [0, {len(self._files)})")
        return self._load(index)

    def _load(self, index: int) -> T:
        sample = self._memory.get(index) if self.owns(index) else None
        if sample is not None:
            return sample
        sample = self.decode(self._read(index))
        if sample is None:
            raise TypeError(f"decode returned None for {self.url(index)}; return the sample")
        if self.owns(index):
            self._memory.put(index, sample)
        return sample

    def _read(self, index: int) -> bytes:
        fs, path, url = self._files[index]
        raw = self._disk.get(url)
        if raw is None:
            start = time.perf_counter()
            raw = fs.cat_file(path)
            with self.stats.lock:
                self.stats.source_reads += 1
                self.stats.source_bytes += len(raw)
                self.stats.source_seconds += time.perf_counter() - start
            self._disk.put(url, raw)
        return raw

    def get_batch(self, indices: Sequence[int]) -> list[T]:
        """The samples at ``indices``, in order. With a Comm: collective, every replica passes
        the indices it wants for this step (see `exchange` for the protocol)."""
        if self._group is None:
            return [self[i] for i in indices]
        with self._collective:
            got = exchange(self._group, indices, len(self._files), self._load)
        with self.stats.lock:
            self.stats.exchange_sent_bytes += got.sent_bytes
            self.stats.exchange_received_bytes += got.received_bytes
        return got.samples

    def prefetch(self, indices: Iterable[int]) -> Future[None]:
        """Load, on a background thread, the samples of ``indices`` this replica owns (all of
        them without a Comm): pass the indices any replica will read next. Not collective."""
        wanted = [i for i in indices if self.owns(i)]

        def run() -> None:
            for i in wanted:
                self[i]

        return self._prefetcher.submit(run)

    def batches(self, index_batches: Iterable[Sequence[int]],
                run_ahead: int = 2) -> Iterator[list[T]]:
        """Yield ``get_batch(b)`` for each ``b``, produced up to ``run_ahead`` batches ahead on
        a background thread, so reads overlap the consumer's compute.

        Time spent producing goes to ``stats.read_seconds``, time the consumer waits to
        ``stats.wait_seconds``. With a Comm every replica must iterate the same number of
        batches, and make no other ``get_batch`` calls meanwhile. Leaving the loop early waits
        for the batch being produced, then stops.
        """
        if run_ahead < 1:
            raise ValueError(f"run_ahead must be >= 1 batches, got {run_ahead}")
        ready: queue.Queue[object] = queue.Queue(maxsize=run_ahead)
        stop = threading.Event()

        def produce() -> None:
            try:
                for b in index_batches:
                    start = time.perf_counter()
                    item: object = self.get_batch(b)
                    with self.stats.lock:
                        self.stats.read_seconds += time.perf_counter() - start
                    if not _put(ready, item, stop):
                        return
            except BaseException as exc:  # handed to the consumer, which re-raises it
                _put(ready, exc, stop)
                return
            _put(ready, _DONE, stop)

        worker = threading.Thread(target=produce, name="salus-run-ahead", daemon=True)
        worker.start()
        try:
            while True:
                start = time.perf_counter()
                item = ready.get()
                with self.stats.lock:
                    self.stats.wait_seconds += time.perf_counter() - start
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield cast(list[T], item)
        finally:
            stop.set()
            worker.join()

    def close(self) -> None:
        """Stop the prefetch thread (queued prefetches finish first)."""
        self._prefetcher.shutdown(wait=True)


def _put(ready: queue.Queue[object], item: object, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer has gone; False once it has."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _list_files(source: str | Sequence[str],
                options: dict[str, Any]) -> list[tuple[AbstractFileSystem, str, str]]:
    """``(filesystem, path, url)`` per sample: a directory's files sorted, or the given URLs."""
    if isinstance(source, str):
        fs, root = fsspec.core.url_to_fs(source, **options)
        paths = sorted(fs.find(root))
        if not paths:
            raise ValueError(f"no files under {source!r}")
        return [(fs, p, fs.unstrip_protocol(p)) for p in paths]
    files = []
    for url in source:
        fs, path = fsspec.core.url_to_fs(url, **options)
        files.append((fs, path, url))
    if not files:
        raise ValueError("the list of sample files is empty")
    return files


def _check_same_files(group: dist.ProcessGroup, urls: list[str]) -> None:
    digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()
    seen: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, digest, group=group)
    if len(set(seen)) != 1:
        raise ValueError("the replicas list different sample files; give every replica the "
                         "same source (same files, same names)")
