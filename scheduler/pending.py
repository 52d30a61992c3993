"""The pending list: jobs waiting for memory, in submit order, searchable by what they need.

Admission re-runs the pending list after every release. At 100k jobs a linear pass per release is
quadratic, so the list keeps a segment tree with two minima per subtree, of persistent bytes and
of persistent + ephemeral bytes: "the first pending job at or after position i with
persistent <= a and persistent + ephemeral <= b" skips every subtree that cannot hold one, and a
leaf is tested exactly. Hand-written because no kept library offers an ordered sequence with a
subtree-minimum search (sortedcontainers is not installed, and would not help).
"""

from __future__ import annotations

from collections.abc import Iterator

from salus.scheduler.job import Job

_EMPTY = float("inf")




class PendingQueue:
    """Jobs in `order_key` order. Positions are stable while no job is inserted, so a pass may
    remove the jobs it admits and keep walking forward."""

    def __init__(self) -> None:
        self._slots: list[Job | None] = []
        self._pos: dict[int, int] = {}
        self._cap = 1
        self._min_p: list[float] = [_EMPTY, _EMPTY]
        self._min_need: list[float] = [_EMPTY, _EMPTY]

    def __len__(self) -> int:
        return len(self._pos)

    def __iter__(self) -> Iterator[Job]:
        return (job for job in self._slots if job is not None)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._pos

    def position(self, job_id: int) -> int:
        return self._pos[job_id]

    def at(self, position: int) -> Job:
        job = self._slots[position]
        if job is None:
            raise KeyError(f"no pending job at position {position}")
        return job

    def insert(self, job: Job) -> None:
        """Add a job at its place in submit order (appending is O(1) amortised)."""
        if job.job_id in self._pos:
            raise ValueError(f"job {job.job_id} is already pending")
        last = self._slots[-1] if self._slots else None
        if last is None or last.order_key <= job.order_key:
            if len(self._slots) == self._cap:
                self._rebuild(None)
            self._append(job)
            return
        # Out of order (a re-queued job, or a clock that went back): rebuild, O(n).
        self._rebuild(sorted([*self, job], key=lambda j: j.order_key))

    def remove(self, job_id: int) -> Job:
        """Take a job out; its position becomes a hole (positions of others do not move)."""
        pos = self._pos.pop(job_id)
        job = self._slots[pos]
        assert job is not None
        self._slots[pos] = None
        self._set(pos, _EMPTY, _EMPTY)
        # Trailing holes are dropped so the last slot is always a live job.
        while self._slots and self._slots[-1] is None:
            self._slots.pop()
        return job

    def first_fitting(self, start: int, persistent_limit: float, need_limit: float) -> int | None:
        """Position of the first job at or after `start` with persistent bytes <=
        persistent_limit and persistent + ephemeral bytes <= need_limit."""
        n = self._cap
        if start >= len(self._slots):
            return None
        min_p, min_need = self._min_p, self._min_need
        # The O(log n) subtrees covering [start, end), left to right, searched depth first.
        lo, hi = start + n, 2 * n
        left: list[int] = []
        right: list[int] = []
        while lo < hi:
            if lo & 1:
                left.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                right.append(hi)
            lo >>= 1
            hi >>= 1
        for root in left + right[::-1]:
            stack = [root]
            while stack:
                i = stack.pop()
                if min_p[i] > persistent_limit or min_need[i] > need_limit:
                    continue
                if i >= n:
                    return i - n
                stack.append(2 * i + 1)
                stack.append(2 * i)
        return None

    # ---- internals -----------------------------------------------------------------------
    def _append(self, job: Job) -> None:
        pos = len(self._slots)
        self._slots.append(job)
        self._pos[job.job_id] = pos
        self._set(pos, job.persistent_bytes, job.persistent_bytes + job.ephemeral_bytes)

    def _set(self, pos: int, persistent: float, need: float) -> None:
        min_p, min_need = self._min_p, self._min_need
        i = pos + self._cap
        min_p[i], min_need[i] = persistent, need
        i >>= 1
        while i:
            a, b = 2 * i, 2 * i + 1
            min_p[i] = min_p[a] if min_p[a] < min_p[b] else min_p[b]
            min_need[i] = min_need[a] if min_need[a] < min_need[b] else min_need[b]
            i >>= 1

    def _rebuild(self, jobs: list[Job] | None) -> None:
        """Compact to `jobs` (default: the current ones) with room to grow to twice the size."""
        ordered = list(self) if jobs is None else jobs
        cap = 1
        while cap < 2 * max(1, len(ordered)):
            cap *= 2
        self._cap = cap
        self._slots = list(ordered)
        self._pos = {job.job_id: i for i, job in enumerate(ordered)}
        min_p = [_EMPTY] * (2 * cap)
        min_need = [_EMPTY] * (2 * cap)
        for i, job in enumerate(ordered):
            min_p[cap + i] = job.persistent_bytes
            min_need[cap + i] = job.persistent_bytes + job.ephemeral_bytes
        for i in range(cap - 1, 0, -1):
            min_p[i] = min(min_p[2 * i], min_p[2 * i + 1])
            min_need[i] = min(min_need[2 * i], min_need[2 * i + 1])
        self._min_p, self._min_need = min_p, min_need
