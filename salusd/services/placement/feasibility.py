"""Whether any split fits: contiguous non-empty stages, in pipeline order, within memory."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .cost import CostModel
from .plan import PlacementInfeasible


def placeable_suffixes(cost: CostModel) -> npt.NDArray[np.bool_]:
    """ok[d, a]: layers a..L-1 can go to devices d..D-1, one non-empty stage each, in memory.

    Dynamic programming from the last device back: a start works for device d if some end b
    with a < b <= (the furthest end device d's memory allows) works for device d + 1.
    """
    num_d, num_l = cost.num_devices, cost.num_layers
    ok = np.zeros((num_d + 1, num_l + 1), dtype=np.bool_)
    ok[num_d, num_l] = True
    starts = np.arange(num_l + 1)
    for d in reversed(range(num_d)):
        hi = cost.max_ends(d)
        reach = np.concatenate([[0], np.cumsum(ok[d + 1])])  # reach[k]: ok[d+1, :k].sum()
        ok[d] = (hi > starts) & (reach[hi + 1] - reach[starts + 1] > 0)
    return ok


def check_feasible(cost: CostModel) -> npt.NDArray[np.bool_]:
    """`placeable_suffixes(cost)`, or `PlacementInfeasible` saying why no split fits."""
    ok = placeable_suffixes(cost)
    if not ok[0, 0]:
        raise PlacementInfeasible(_why_infeasible(cost))
    return ok


def _why_infeasible(cost: CostModel) -> str:
    need = cost.stage_memory_bytes(0, cost.num_layers)
    have = int(cost.capacity_bytes.sum())
    if cost.num_layers < cost.num_devices:
        return f"{cost.num_layers} layers cannot give each of {cost.num_devices} devices a stage"
    if need > have:
        return f"the layers need {need} bytes; the devices have {have} in all"
    return (f"no contiguous split of {cost.num_layers} layers ({need} bytes) over "
            f"{cost.num_devices} devices ({have} bytes in all) fits every device's memory")
