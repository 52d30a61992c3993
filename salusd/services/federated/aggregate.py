"""Server-side aggregation: a weighted average of client ``state_dict`` s (a pure function)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def weighted_average(
    states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """``sum_i weights[i] * states[i][key] / sum_i weights[i]`` for every key.

    Accumulates in float64 (as the reference code does) and returns each entry in its input
    dtype; integer entries (counters such as BatchNorm's ``num_batches_tracked``) are rounded.
    Weights are non-negative with a positive sum; the inputs are not modified.
    """
    if not states or len(states) != len(weights):
        raise ValueError("need one weight per state and at least one state")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    keys = states[0].keys()
    if any(s.keys() != keys for s in states):
        raise ValueError("all states need the same keys")
    total = float(sum(weights))
    averaged = {}
    for key in keys:
        acc = torch.zeros(states[0][key].shape, dtype=torch.float64)
        for state, weight in zip(states, weights, strict=True):
            acc += float(weight) * state[key].detach().to(torch.float64)
        acc /= total
        dtype = states[0][key].dtype
        averaged[key] = (acc if dtype.is_floating_point else acc.round()).to(dtype)
    return averaged
