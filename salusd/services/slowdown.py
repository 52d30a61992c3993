"""Simulated slow devices, as the Sky Computing experiments made them on a uniform cluster.

The anchor (hpcaitech/SkyComputing, `Stimulator`) gives each worker seeded random slowdowns:
compute time x U[1, 2), available memory / U[1, 3), network time x U[1, 2). `draw_slowdowns`
draws the same distributions; `ComputeSlowdown` makes real work take `factor` times as long by
sleeping after it, which is how `salusd serve --cpu-device-slowdown` slows a CPU device's
executors. A simulation of a slower device, not a slower device.

This module imports neither torch nor numpy at import time: the daemon (which never imports
torch) parses `--cpu-device-slowdown` with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class DeviceSlowdown:
    """Factors >= 1: compute time x `compute`, memory budget / `memory`, link time x `network`."""

    compute: float
    memory: float
    network: float

    def __post_init__(self) -> None:
        for field in ("compute", "memory", "network"):
            if not getattr(self, field) >= 1.0:
                raise ValueError(f"slowdown {field} must be a number >= 1, "
                                 f"got {getattr(self, field)}")


def draw_slowdowns(num_devices: int, seed: int) -> list[DeviceSlowdown]:
    """`num_devices` seeded slowdowns: compute U[1, 2), memory U[1, 3), network U[1, 2).

    Device i's factors do not depend on `num_devices`: a larger cluster of the same seed
    extends a smaller one.
    """
    import numpy as np

    u = np.random.default_rng(seed).random((num_devices, 3))
    return [DeviceSlowdown(1 + float(c), 1 + 2 * float(m), 1 + float(n)) for c, m, n in u]


class ComputeSlowdown:
    """A reusable context: the enclosed work takes `factor` times as long.

    On leaving, it sleeps (factor - 1) x the seconds `clock` advanced inside; a block that
    raises is not slowed. With the default clock, `time.thread_time` (this thread's CPU
    seconds), only computation counts: time spent blocked (waiting for a peer's message, for
    I/O) is not stretched, as a slower processor would not stretch it either. The device is
    idle while it sleeps, so other processes sharing it are not slowed, which is what a
    separate slow device would give. Blocks may nest; each is slowed once, by its own time.
    `factor` may be changed between blocks (the executor does when its job moves device).
    """

    def __init__(self, factor: float = 1.0, clock: Callable[[], float] = time.thread_time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.factor = check_factor(factor)
        self.clock = clock
        self.sleep = sleep
        self._starts: list[float] = []

    def __enter__(self) -> ComputeSlowdown:
        self._starts.append(self.clock() if self.factor > 1.0 else 0.0)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        start = self._starts.pop()
        if exc_type is None and self.factor > 1.0:
            self.sleep((self.factor - 1.0) * (self.clock() - start))


def compute_slowdown(
    factor: float,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> ComputeSlowdown:
    """Make the enclosed block take `factor` times its wall time (`clock`): it runs the block,
    then sleeps (factor - 1) x its elapsed seconds; a block that raises is not slowed. See
    `ComputeSlowdown`, which this returns."""
    return ComputeSlowdown(factor, clock, sleep)


def check_factor(factor: float) -> float:
    """`factor` as a float if it is a number >= 1 (ValueError otherwise)."""
    if not float(factor) >= 1.0:
        raise ValueError(f"a slowdown factor must be >= 1, got {factor}")
    return float(factor)
