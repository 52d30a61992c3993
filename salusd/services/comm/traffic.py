"""Bytes one rank sends in each collective, and the per-replica counters a `Comm` keeps.

Point-to-point transfers (the tree allreduce) are counted exactly. Collectives run by the
backend are counted with the algorithms gloo runs on CPU, checked against the bytes each
process wrote to its sockets (``wchar`` in ``/proc/self/io``) for 2 and 4 ranks: ring
allreduce ``2 (n - 1) / n * B``, all-gather ``(n - 1) * B_in``, all-to-all ``(n - 1) / n * B``,
binomial-tree broadcast (``B`` per child). On NCCL the same formulas are an estimate (NCCL may
choose trees); its broadcast is counted as a chain (``B`` for every rank but the last).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes a rank sends in a ring allreduce of ``nbytes`` bytes over ``n`` ranks."""
    return 2 * (n - 1) * nbytes // n


def all_gather_bytes(in_bytes: int, n: int) -> int:
    """Bytes a rank sends when ``n`` ranks all-gather ``in_bytes`` bytes each (ring)."""
    return (n - 1) * in_bytes


def all_to_all_bytes(in_bytes: int, n: int) -> int:
    """Bytes a rank sends in an all-to-all of ``in_bytes`` bytes split evenly over ``n``."""
    return (n - 1) * in_bytes // n


def broadcast_bytes(nbytes: int, n: int, rank: int, src: int, backend: str) -> int:
    """Bytes group rank ``rank`` sends when ``src`` broadcasts ``nbytes`` bytes to ``n`` ranks.

    gloo: a binomial tree, where relative rank ``v`` sends to ``v + 2**j`` for each ``2**j >
    v`` below ``n``. Other backends: a chain, where every rank but the last forwards once.
    """
    v = (rank - src) % n
    if backend != "gloo":
        return nbytes if v < n - 1 else 0
    children, step = 0, 1
    while v + step < n:
        if step > v:
            children += 1
        step *= 2
    return children * nbytes


@dataclass
class CommStats:
    """Per-replica counters of one `Comm`, for benchmarks and job info.

    ``bytes_sent``: bytes this rank sent in all calls; ``calls`` and ``bytes_by_kind``: the
    same per call kind (``"all_reduce.ring"``, ``"sparse_all_reduce"``, ``"broadcast"``...).
    Updated by the Comm's worker thread; ``snapshot()`` is safe from any thread.
    """

    bytes_sent: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    last_algorithm: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, kind: str, nbytes: int) -> None:
        """Record one call of ``kind`` that sent ``nbytes`` bytes from this rank."""
        with self._lock:
            self.bytes_sent += nbytes
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes

    def snapshot(self) -> dict[str, object]:
        """A JSON-ready copy of the counters."""
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "calls": dict(self.calls),
                "bytes_by_kind": dict(self.bytes_by_kind),
                "last_algorithm": self.last_algorithm,
            }
