"""Closed forms for the `fair` policy on one lane, so the simulator can skip ahead many iterations.

At each boundary `fair` runs the job with the least (attained / priority, submit order). A job
with attained a, priority w and iteration time s therefore starts its k-th next iteration at
"virtual time" x_k = (a + k*s) / w, and the lane runs iterations in increasing (x, submit order):
the sequence is the merge of one arithmetic progression per job. Until the lane's set of jobs
changes, every question the simulator asks (how far does the leader run before it loses the lead,
which job finishes first, which iteration is in flight at time t) is a count over these
progressions, answered here in O(jobs) or O(jobs²) instead of one step per iteration.

All counts are checked with the exact comparison that stepping would make, so in exact arithmetic
the result is the stepped schedule; floats can differ only where two jobs' attained service ties
up to rounding.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

Key = tuple[float, int]


@dataclass(frozen=True)
class Share:
    """One job's state on the lane: attained seconds, priority weight, seconds per iteration,
    iterations left, and its tie-break key (submit time, job id)."""

    attained_s: float
    weight: float
    iter_s: float
    left: int
    key: Key

    def x(self, k: int) -> float:
        """Virtual start time of the job's k-th next iteration (seconds / weight)."""
        return (self.attained_s + k * self.iter_s) / self.weight

    def before(self, k: int, v: float, key: Key) -> bool:
        """Whether iteration k comes before a start at virtual time v of the job keyed `key`."""
        x = self.x(k)
        return x < v or (x == v and self.key < key)

    def count_before(self, v: float, key: Key, limit: int) -> int:
        """How many of iterations 0..limit-1 come before (v, key)."""
        guess = (v * self.weight - self.attained_s) / self.iter_s
        k = min(limit, max(0, math.ceil(guess) if math.isfinite(guess) else limit))
        while k > 0 and not self.before(k - 1, v, key):
            k -= 1
        while k < limit and self.before(k, v, key):
            k += 1
        return k


def iterations_until_overtaken(leader: Share, rival_v: float, rival_key: Key) -> int:
    """Smallest m >= 1 such that after m iterations `leader` no longer runs before a rival at
    virtual time rival_v (i.e. how many iterations the leader runs back to back)."""

    def loses(m: int) -> bool:
        return not leader.before(m, rival_v, rival_key)

    guess = (rival_v * leader.weight - leader.attained_s) / leader.iter_s
    m = max(1, math.floor(guess) + 1 if math.isfinite(guess) else 1)
    while m > 1 and loses(m - 1):
        m -= 1
    while not loses(m):
        m += 1
    return m


@dataclass(frozen=True)
class Plan:
    """Iterations each share runs (in lane order: merged progressions) up to `finisher`'s last
    one; `duration_s` is their total time (the lane runs at full speed)."""

    counts: tuple[int, ...]
    finisher: int
    duration_s: float


def plan(shares: list[Share]) -> Plan:
    """Run the lane until its first job finishes: that job's last iteration is the earliest of
    the jobs' last iterations in lane order; every other job runs what comes before it."""
    lasts = [(sh.x(sh.left - 1), sh.key) for sh in shares]
    f = min(range(len(shares)), key=lasts.__getitem__)
    v, key = lasts[f]
    counts = tuple(
        sh.left if i == f else sh.count_before(v, key, sh.left) for i, sh in enumerate(shares)
    )
    return Plan(counts, f, duration(shares, counts))


def duration(shares: list[Share], counts: tuple[int, ...]) -> float:
    return math.fsum(c * sh.iter_s for sh, c in zip(shares, counts, strict=True))


def cut(shares: list[Share], counts: tuple[int, ...], elapsed_s: float) -> tuple[int, ...]:
    """The shortest prefix (in lane order) of the planned iterations that reaches `elapsed_s`:
    the iterations done by then plus the one in flight (at least one iteration)."""
    if elapsed_s >= duration(shares, counts):
        return counts
    cur = list(_estimate(shares, counts, elapsed_s))
    wall = duration(shares, tuple(cur))
    # Step back to strictly before `elapsed_s`, then forward to the first boundary at or after.
    while wall >= elapsed_s and any(cur):
        i = max(
            (i for i, c in enumerate(cur) if c),
            key=lambda i: (shares[i].x(cur[i] - 1), shares[i].key),
        )
        cur[i] -= 1
        wall -= shares[i].iter_s
    while True:
        i = min(
            (i for i, c in enumerate(cur) if c < counts[i]),
            key=lambda i: (shares[i].x(cur[i]), shares[i].key),
        )
        cur[i] += 1
        wall += shares[i].iter_s
        if wall >= elapsed_s or tuple(cur) == counts:
            return tuple(cur)


def _estimate(shares: list[Share], counts: tuple[int, ...], elapsed_s: float) -> list[int]:
    """Counts near the cut from the fluid view: while its progression is open a job costs
    `weight` wall seconds per unit of virtual time."""
    events: list[tuple[float, float]] = []
    for sh, c in zip(shares, counts, strict=True):
        if c:
            events.append((sh.x(0), sh.weight))
            events.append((sh.x(c), -sh.weight))
    events.sort()
    wall, slope, v = 0.0, 0.0, events[0][0] if events else 0.0
    for point, dslope in events:
        step = (point - v) * slope
        if wall + step >= elapsed_s and slope > 0:
            v += (elapsed_s - wall) / slope
            break
        wall += step
        v = point
        slope += dslope
    low_key: Key = (-math.inf, -1)
    return [sh.count_before(v, low_key, c) for sh, c in zip(shares, counts, strict=True)]


def first_offset(shares: list[Share], counts: tuple[int, ...], i: int) -> float:
    """Seconds from the segment start to the first iteration of share `i` (which runs)."""
    v, key = shares[i].x(0), shares[i].key
    return math.fsum(
        other.iter_s * other.count_before(v, key, counts[j])
        for j, other in enumerate(shares)
        if j != i
    )


def sequence(shares: list[Share], counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The planned iterations in lane order as (share index, run length), runs of the same job
    merged; for timelines and tests, O(iterations)."""
    heap = [(sh.x(0), sh.key, i, 0) for i, sh in enumerate(shares) if counts[i]]
    heapq.heapify(heap)
    runs: list[tuple[int, int]] = []
    while heap:
        _, _, i, k = heapq.heappop(heap)
        if runs and runs[-1][0] == i:
            runs[-1] = (i, runs[-1][1] + 1)
        else:
            runs.append((i, 1))
        if k + 1 < counts[i]:
            heapq.heappush(heap, (shares[i].x(k + 1), shares[i].key, i, k + 1))
    return runs
