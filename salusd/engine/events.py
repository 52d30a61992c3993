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
    engine's clock. Kinds and their details (times in seconds, sizes in bytes):

    - open (owner, name, job_kind: interactive, batch or script), reattach (iteration: a
      restored job's client is back), attach (persistent_bytes, and resumed_from after a
      restore), submit (persistent, ephemeral, method), admit (device, lane), requeue (device,
      lane, peak), suspend (swap), resume, swap_out, priority (priority);
    - end: one call ended in a lane (seconds, iterations 0 or 1, ok, began and ended on the
      executor's monotonic clock; cache, the data cache's counters, when the job uses one);
    - ran: calls a leased job ran on its own (calls, iterations, seconds; with the lane, began
      and ended while the job is live);
    - finish / cancelled / failed (reason, iterations_done; exit_status, signal, limit: how a
      script job's command ended, else None): the job ended;
      exit (exit_status, signal, limit): a script job's command ended after its job did (a
      cancelled job's, or one that hit its time limit, in its grace);
      executor_died (reason);
    - restart (reason, restarts): a script job's command runs again (`--restart on-failure`);
      replaced (reason, resumed_from, replacements): a batch job whose executor ended with a
      poisoned CUDA context goes on from its checkpoint in a fresh executor (`replace.py`);
      script_swap (what a script job's `suspend --swap` moved and left, or moved back);
      swapped_out (device_bytes_left): a contract job's state left its device, and what
      stayed allocated there (0 on a CPU device);
      progress (step, max_steps, loss): what a script's framework callback reported;
    - reject (reason): admission found the job can never fit (a `failed` follows);
    - checkpoint (iteration, seconds, bytes, path, time in Unix seconds): the job's state was
      written;
    - policy (no job; policy, previous): the scheduling policy was switched;
    - memory (no job): devices = [{device, capacity_bytes, persistent_bytes, lane_bytes,
      free_bytes, lanes}], pending = jobs waiting for admission; sent when admissions changed
      what it shows."""

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
