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

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from salus.daemon.counters import sum_counters
from salus.daemon.wire.executor_ops import Failed, Reply, failure, succeeded
from salus.daemon.wire.frames import RawFrame


@dataclass(eq=False)
class GangReply:
    """Collects one message's replies from `expected` replicas."""

    expected: int
    lanes: list[tuple[int, int]] = field(default_factory=list)  # a step's lanes, by replica
    replies: dict[int, Reply] = field(default_factory=dict)
    frame: RawFrame | None = None  # replica 0's reply frame (what a client would get)
    head: Any = None  # the engine's record of what replica 0 was sent
    waiting: bool = False  # a replica failed: the others are given a grace time to answer
    abandoned: bool = False  # they did not: the call was answered and the job failed

    @property
    def complete(self) -> bool:
        return len(self.replies) == self.expected

    def failed(self) -> list[int]:
        """Replicas whose reply says they failed, in rank order."""
        return sorted(r for r, m in self.replies.items() if not succeeded(m))

    def raised(self) -> str:
        """Which replicas' calls raised, and the first one's message (for a job's reason)."""
        failed = self.failed()
        return (f"the call raised on replica(s) {failed} "
                f"({failure(self.replies[failed[0]])[:1000]})")

    def diverged(self) -> bool:
        """Some replicas failed and the others did not (an interactive call raised on part of
        the gang, which leaves the replicas' states unequal)."""
        return 0 < len(self.failed()) < self.expected

    def add(self, replica: int, reply: Reply, frame: RawFrame | None) -> bool:
        """Record `replica`'s reply; True once every replica has answered."""
        if replica == 0:
            self.frame = frame
        elif frame is not None:
            frame.close_fd()
        self.replies[replica] = reply
        return self.complete

    def merged(self) -> Reply:
        return merge([self.replies[r] for r in range(self.expected)])


def merge(replies: list[Reply]) -> Reply:
    """One reply standing for the replicas' `replies` (replica order); see the module
    docstring."""
    head = replies[0]
    has = {f.name for f in dataclasses.fields(head)}
    out: dict[str, Any] = {}

    def values(key: str, *kinds: type) -> list[Any]:
        return [v for m in replies if type(v := getattr(m, key, None)) in kinds]

    if "seconds" in has:
        out["seconds"] = max(float(v) for v in values("seconds", int, float))
    if "peak" in has:
        peaks = values("peak", int)
        out["peak"] = max(peaks) if peaks else None
    if "loss" in has:
        losses = values("loss", int, float)
        out["loss"] = sum(losses) / len(losses) if len(losses) == len(replies) else None
    for key, pick in (("began", min), ("ended", max)):
        if key in has and values(key, int, float):
            out[key] = pick(values(key, int, float))
    for key in ("persistent_bytes", "persistent_reserved_bytes"):
        if getattr(head, key, None) is not None:
            out[key] = max(int(getattr(m, key, None) or 0) for m in replies)
    caches = values("cache", dict)
    if caches and "cache" in has:  # each replica reads and holds its own share: their sum
        out["cache"] = sum_counters(caches)
    comms = values("comm", dict)
    if comms and "comm" in has:  # bytes and calls of all; the algorithm replica 0's picked
        out["comm"] = {**sum_counters(comms), "last_algorithm": comms[0].get("last_algorithm")}
    swaps = values("swap", dict)
    lefts = [swap.get("device_bytes_left") for swap in swaps]
    if "swap" in has and len(lefts) == len(replies) and all(type(v) is int for v in lefts):
        out["swap"] = {**swaps[0], "device_bytes_left": sum(lefts)}  # each on its device
    failed = next((r for r, m in enumerate(replies) if not succeeded(m)), None)
    if failed is not None:
        bad = replies[failed]
        return _failed(dataclasses.replace(head, **out), f"replica {failed}: {failure(bad)}",
                       getattr(bad, "traceback", None))
    if "path" in has:  # a checkpoint: every replica wrote its part
        out["bytes"] = sum(int(getattr(m, "bytes", 0)) for m in replies)
    merged = dataclasses.replace(head, **out)
    iterations = {getattr(m, "iteration", None) for m in replies}
    if len(iterations) > 1:
        seen = sorted(map(str, iterations))
        return _failed(merged, f"the replicas stand at different iterations {seen}; their "
                               "checkpoints do not match", None)
    return merged


def _failed(head: Reply, message: str, traceback: str | None) -> Reply:
    """`head` made a failure saying `message`: itself with `ok` false where it has an `ok`
    (a call's or an iteration's accounting stays), else `Failed`."""
    has = {f.name for f in dataclasses.fields(head)}
    if "ok" not in has:
        return Failed(message, bool(getattr(head, "forward", False)))
    extra = {"traceback": traceback} if "traceback" in has and traceback is not None else {}
    failing: Any = head  # one of the replies with an `ok` (a call's or an iteration's)
    return dataclasses.replace(failing, ok=False, message=message, **extra)
