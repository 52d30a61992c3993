"""The engine's event stream: the log, metrics and persistence subscribe to it.

Subscribers run on the engine's thread right after the change they describe, so they must be
quick and must not call back into the engine; one that raises is logged and dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("salusd.events")


@dataclass(frozen=True)
class Event:
    """One change: `kind`, the job (-1 for none), where, and details; `t` is seconds on the
    engine's clock. Kinds and their details:

    - open (owner, name), attach (persistent_bytes), submit (persistent, ephemeral, method),
      admit (device, lane), requeue (peak), suspend (swap), resume, swap_out, priority;
    - end: one call ended in a lane (seconds, iterations 0 or 1, ok);
    - ran: calls a leased job ran on its own (calls, iterations, seconds);
    - finish / cancelled / failed (reason): the job ended; executor_died (reason);
    - reject (reason): admission found the job can never fit (a `failed` follows);
    - checkpoint (iteration, seconds, bytes): the job's state was written;
    - memory (no job): devices = [{device, capacity_bytes, persistent_bytes, lane_bytes,
      free_bytes, lanes}], pending = jobs waiting for admission; sent after every change of
      admissions."""

    t: float
    kind: str
    job_id: int
    device: int = -1
    lane_id: int = -1
    detail: dict[str, Any] = field(default_factory=dict)


Subscriber = Callable[[Event], None]


class EventStream:
    """Fan-out of events to subscribers, with the last `keep` events kept for inspection."""

    def __init__(self, keep: int = 10_000) -> None:
        self.recent: deque[Event] = deque(maxlen=keep)
        self._subscribers: list[Subscriber] = []

    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    def emit(self, event: Event) -> None:
        self.recent.append(event)
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:
                log.exception("event subscriber %r failed; dropping it", fn)
                self._subscribers.remove(fn)
