"""Replies of a gang's replicas to one message, merged into the one reply the engine accounts.

The engine sends a gang job's `load`, `step` and `checkpoint` to every replica; each replica
answers on its own executor link, in its own time. `GangReply` collects the answers and, once
all are in, gives one reply in the single-executor form: ok only when every replica was ok (the
first failure's message, named by replica), the slowest replica's seconds, the largest peak
(each device holds one replica), the mean loss, replica 0's evaluation and iteration, the sum
of the replicas' data cache and communication counters, for a checkpoint the bytes of all
replicas, and for a swap-out the device bytes all replicas left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from salus.daemon.counters import sum_counters
from salus.daemon.wire.frames import RawFrame


@dataclass(eq=False)
class GangReply:
    """Collects one message's replies from `expected` replicas."""

    expected: int
    lanes: list[tuple[int, int]] = field(default_factory=list)  # a step's lanes, by replica
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)
    frame: RawFrame | None = None  # replica 0's reply frame (what a client would get)
    head: Any = None  # the engine's record of what replica 0 was sent
    waiting: bool = False  # a replica failed: the others are given a grace time to answer
    abandoned: bool = False  # they did not: the call was answered and the job failed

    @property
    def complete(self) -> bool:
        return len(self.metas) == self.expected

    def failed(self) -> list[int]:
        """Replicas whose reply says they failed, in rank order."""
        return sorted(r for r, m in self.metas.items() if not m.get("ok"))

    def raised(self) -> str:
        """Which replicas' calls raised, and the first one's message (for a job's reason)."""
        failed = self.failed()
        return (f"the call raised on replica(s) {failed} "
                f"({str(self.metas[failed[0]].get('message', ''))[:1000]})")

    def diverged(self) -> bool:
        """Some replicas failed and the others did not (an interactive call raised on part of
        the gang, which leaves the replicas' states unequal)."""
        return 0 < len(self.failed()) < self.expected

    def add(self, replica: int, meta: dict[str, Any], frame: RawFrame | None) -> bool:
        """Record `replica`'s reply; True once every replica has answered."""
        if replica == 0:
            self.frame = frame
        elif frame is not None:
            frame.close_fd()
        self.metas[replica] = meta
        return self.complete

    def merged(self) -> dict[str, Any]:
        return merge([self.metas[r] for r in range(self.expected)])


def merge(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """One reply standing for the replicas' `metas` (replica order); see the module docstring."""
    out = dict(metas[0])
    failed = next((r for r, m in enumerate(metas) if not m.get("ok")), None)
    out["ok"] = failed is None
    if failed is not None:
        bad = metas[failed]
        out["message"] = f"replica {failed}: {bad.get('message', 'no reason given')}"
        if "traceback" in bad:
            out["traceback"] = bad["traceback"]
    if all(isinstance(m.get("seconds"), int | float) for m in metas):
        out["seconds"] = max(float(m["seconds"]) for m in metas)
    peaks = [m["peak"] for m in metas if isinstance(m.get("peak"), int)]
    out["peak"] = max(peaks) if peaks else None
    losses = [m["loss"] for m in metas if isinstance(m.get("loss"), int | float)]
    out["loss"] = sum(losses) / len(losses) if len(losses) == len(metas) else None
    for key, pick in (("began", min), ("ended", max)):
        values = [m[key] for m in metas if isinstance(m.get(key), int | float)]
        if values:
            out[key] = pick(values)
    for key in ("persistent_bytes", "persistent_reserved_bytes"):
        if key in out:
            out[key] = max(int(m.get(key, 0)) for m in metas)
    if out["ok"] and "bytes" in out:  # a checkpoint: every replica wrote its part
        out["bytes"] = sum(int(m.get("bytes", 0)) for m in metas)
    caches = [m["cache"] for m in metas if isinstance(m.get("cache"), dict)]
    if caches:  # each replica reads and holds its own share: the gang's is their sum
        out["cache"] = sum_counters(caches)
    comms = [m["comm"] for m in metas if isinstance(m.get("comm"), dict)]
    if comms:  # bytes and calls of all replicas; the algorithm replica 0's "auto" picked
        out["comm"] = {**sum_counters(comms), "last_algorithm": comms[0].get("last_algorithm")}
    lefts = [m["swap"].get("device_bytes_left") for m in metas if isinstance(m.get("swap"), dict)]
    if len(lefts) == len(metas) and all(type(v) is int for v in lefts):  # each on its device
        out["swap"] = {**out["swap"], "device_bytes_left": sum(lefts)}
    iterations = {m.get("iteration") for m in metas}
    if out["ok"] and len(iterations) > 1:
        out["ok"] = False
        seen = sorted(map(str, iterations))
        out["message"] = (f"the replicas stand at different iterations {seen}"
                          "; their checkpoints do not match")
    return out
