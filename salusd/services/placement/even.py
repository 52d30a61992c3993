"""The baseline allocator: the same number of layers on every device."""

from __future__ import annotations

import time
from collections.abc import Callable

from .cost import CostModel
from .plan import PlacementInfeasible, Plan


def even_boundaries(num_layers: int, num_devices: int) -> tuple[int, ...]:
    """Stage boundaries giving each device L // D layers, the first L % D devices one more."""
    if num_layers < num_devices:
        raise PlacementInfeasible(
            f"{num_layers} layers cannot give each of {num_devices} devices a stage")
    per, extra = divmod(num_layers, num_devices)
    return tuple(d * per + min(d, extra) for d in range(num_devices + 1))


def allocate_even(cost: CostModel, clock: Callable[[], float] = time.perf_counter) -> Plan:
    """Split the layers evenly by count over the devices, in pipeline order.

    Raises `PlacementInfeasible` when that split leaves a device over its memory, even if
    another split would fit (the other allocators look for one).
    """
    start = clock()
    b = even_boundaries(cost.num_layers, cost.num_devices)
    over = [d for d in range(cost.num_devices) if not cost.fits(d, b[d], b[d + 1])]
    if over:
        d = over[0]
        raise PlacementInfeasible(
            f"the even split gives device {d} layers {b[d]}..{b[d + 1] - 1}, which need "
            f"{cost.stage_memory_bytes(b[d], b[d + 1])} bytes; it has {cost.capacity_bytes[d]}")
    return cost.plan("even", b, clock() - start, "even")
