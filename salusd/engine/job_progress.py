"""What a job has done so far, as the engine counts it beside its record
(`JobRecord.progress`): its calls, where a restart or a replacement took it up again, and what
its last iteration reported. Its views (`report.py`, REST, metrics) read these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class JobProgress:
    """`calls_done` and `calls_failed`: the client's calls answered, and those that raised.
    `resumed_from`: the iteration a restored job went on from (None: never restored);
    `done_before`: iterations done before the last restart; `replacements`: times placed again
    after its executor's context was poisoned. What the last iteration reported: a batch job's
    `last_loss`, `last_evaluation` (what `evaluate` returned) and data sets' `cache` counters,
    a gang's `comm` (what `s.comm` sent over all replicas, its last algorithm)."""

    calls_done: int = 0
    calls_failed: int = 0
    resumed_from: int | None = None
    done_before: int = 0
    replacements: int = 0
    last_loss: float | None = None
    last_evaluation: Any = None
    cache: dict[str, Any] | None = None
    comm: dict[str, Any] | None = None
