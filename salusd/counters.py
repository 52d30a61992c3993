"""Nested counters as JSON-ready dicts (a data cache's per-level hits and bytes), added up.

Standard library only: the daemon (merging a gang's replies) and the executors both use it.
"""

from __future__ import annotations

from typing import Any


def sum_counters(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """`snapshots` added up key by key, nested dicts recursively; other values are dropped."""
    total: dict[str, Any] = {}
    for snap in snapshots:
        for key, value in snap.items():
            if isinstance(value, dict):
                total[key] = sum_counters([total.get(key, {}), value])
            elif isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total
