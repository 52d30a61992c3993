"""`salus.data`: data sets for jobs, served through the node's multi-level cache.

    from salus.data import CachedDataset

    def make_job():
        images = CachedDataset("s3://bucket/train/", decode_jpeg)    # any fsspec URL
        loader = ReplicaLoader(images, batch_size=64)    # or DataLoader(images, ...)
        ...

Inside a salusd batch job (the entrypoint runs in the job's executor), `CachedDataset` uses
what the daemon gives the job: level 1 in the node's cache directory (`salusd serve
--cache-dir`, one folder per owner, `--cache-bytes` per replica) and, in a gang, level 2
sharded over the replicas through the gang's `s.comm`. Its hits, misses and bytes appear in the
job's info (`salusd status`, `GET /v1/jobs/{id}` under `cache`) and in the metrics. In a
gang, `ReplicaLoader` has each replica read only its part of every batch (a `DataLoader` works
too, but every replica then reads whole batches). Run
directly, it caches under ``~/.cache/salus/data`` (10 GiB) on its own. Any argument given wins.
The cache itself is `salus.daemon.services.datacache` (see its docstrings).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from salus.daemon.services import job_context as context
from salus.daemon.services.comm import Comm
from salus.daemon.services.datacache import CachedDataset as _CachedDataset
from salus.daemon.services.datacache import CacheStats, ReplicaLoader

T = TypeVar("T")

DEFAULT_DIR = os.path.join("~", ".cache", "salus", "data")
DEFAULT_BYTES = 10 << 30
_UNSET: Any = object()


class CachedDataset(_CachedDataset[T]):
    """`salus.daemon.services.datacache.CachedDataset` with the job's defaults (module
    docstring): ``comm`` defaults to the gang's (pass None for a replica-local cache)."""

    def __init__(
        self,
        source: str | Sequence[str],
        decode: Callable[[bytes], T],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = None,
        comm: Comm | None = _UNSET,
        memory_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        job = context.current()
        later = comm is _UNSET and job is not None and job.gang and job.comm is None
        if comm is _UNSET:
            comm = job.comm if job is not None else None
        if cache_dir is None:
            cache_dir = (job.cache_dir if job is not None and job.cache_dir else
                         os.path.expanduser(DEFAULT_DIR))
        if cache_bytes is None:
            cache_bytes = (job.cache_bytes if job is not None and job.cache_bytes else
                           DEFAULT_BYTES)
        super().__init__(source, decode, cache_dir=cache_dir, cache_bytes=cache_bytes,
                         comm=comm, memory_bytes=memory_bytes, storage_options=storage_options,
                         comm_later=later)
        if job is not None:
            job.datasets.append(self)
            if later:  # built before the replica joined its gang: bound when it does
                job.unbound.append(self)


__all__ = ["CacheStats", "CachedDataset", "ReplicaLoader"]
