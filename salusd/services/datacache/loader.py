"""`ReplicaLoader`: a gang's batches from a `CachedDataset`, each replica reading only its part.

A batch job's data is iterated alike by every replica and each keeps its slice of every batch
(`salusd/executor/gang.py`); with a plain `DataLoader` each replica would read the whole batch
to keep half of it. A `ReplicaLoader` reads only this replica's slice (`torch.tensor_split` of
the batch's sample indices, the slice the gang would have kept), through the cache's exchange
(each sample read and decoded once in the gang, by its owner), run ahead of compute on a
background thread; it says so with ``per_replica = True``, and the executor does not split
its batches again.

The order of an epoch is drawn from torch's global generator when the epoch starts
(``torch.randperm``), as a shuffling `DataLoader` draws it, so every replica draws the same
order and a restored job replays it (the batch job's cursor restores the generator's state at
the epoch's start).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import default_collate

from .dataset import CachedDataset

T = TypeVar("T")


class ReplicaLoader(Generic[T]):
    """Batches of ``batch_size`` samples of ``dataset`` (the last one smaller unless
    ``drop_last``), shuffled each epoch when ``shuffle``, each collated by ``collate`` from
    this replica's part; ``run_ahead`` batches are read ahead of the consumer."""

    per_replica = True  # the executor must not split these batches again

    def __init__(self, dataset: CachedDataset[T], batch_size: int, *, shuffle: bool = True,
                 drop_last: bool = False, collate: Callable[[list[T]], Any] = default_collate,
                 run_ahead: int = 2) -> None:
        if batch_size < dataset.size:
            raise ValueError(f"batch_size {batch_size} leaves some of the {dataset.size} "
                             "replicas without a sample; use at least one per replica")
        if run_ahead < 1:
            raise ValueError(f"run_ahead must be >= 1 batches, got {run_ahead}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.collate = collate
        self.run_ahead = run_ahead

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batch_indices(self) -> list[list[int]]:
        """One epoch's batches of sample indices, whole (draws the order when shuffling)."""
        n = len(self.dataset)
        order = torch.randperm(n) if self.shuffle else torch.arange(n)
        batches = [order[i:i + self.batch_size] for i in range(0, n, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return [b.tolist() for b in batches]

    def parts(self, batches: Sequence[Sequence[int]]) -> list[list[int]]:
        """This replica's slice of each batch: what `torch.tensor_split` would keep."""
        rank, size = self.dataset.rank, self.dataset.size
        return [torch.tensor_split(torch.tensor(b, dtype=torch.long), size)[rank].tolist()
                for b in batches]

    def __iter__(self) -> Iterator[Any]:
        for samples in self.dataset.batches(self.parts(self.batch_indices()), self.run_ahead):
            yield self.collate(samples)
