"""What a job's code can ask of the executor it runs in: its gang's Comm and its data cache.

The executor sets the context before it calls a batch job's entrypoint (`runtime.load`), so
services a job builds there find the daemon's settings without being told: a
`salus.data.CachedDataset` takes the gang's Comm (level 2 sharded over the replicas; a gang's
replica joins its group once placed, after the entrypoint ran, so the data set is bound to it
then: `joined`) and the
node's cache directory and cap (`salusd serve --cache-dir/--cache-bytes`), and registers itself
so that its counters go into every step's reply (the job's info and metrics). Outside an
executor (a script run directly) there is no context and the services use their own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from salus.daemon.counters import sum_counters
from salus.daemon.services.datacache import CachedDataset

if TYPE_CHECKING:  # imported by a gang's replicas when they join (executor/gang.py)
    from salus.daemon.services.comm import Comm


@dataclass
class JobContext:
    """One job's services in this executor."""

    comm: Comm | None = None
    cache_dir: str | None = None  # this owner's part of the node's cache (level 1)
    cache_bytes: int | None = None  # level 1's cap per replica
    datasets: list[CachedDataset[Any]] = field(default_factory=list)
    gang: bool = False  # a gang's replica: its Comm comes once it joined (`joined`)
    unbound: list[CachedDataset[Any]] = field(default_factory=list)  # wait for that Comm

    def joined(self, comm: Comm) -> None:
        """The replica joined its gang's group: the data sets built before take its Comm."""
        self.comm = comm
        while self.unbound:
            self.unbound.pop(0).bind(comm)

    def cache_stats(self) -> dict[str, Any] | None:
        """The counters of every data set the job made, summed; None when it made none."""
        if not self.datasets:
            return None
        return sum_counters([d.stats.snapshot() for d in self.datasets])


_current: JobContext | None = None


def current() -> JobContext | None:
    """The context of the job this executor runs, or None outside an executor."""
    return _current


def activate(context: JobContext | None) -> None:
    global _current
    _current = context
