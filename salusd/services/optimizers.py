"""Rebuilding a user's optimizer over other parameters (a PTO shard, a pipeline stage)."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def rebuilt(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
            ) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class over `groups` (each carrying its hyperparameters),
    given its defaults as far as the class's constructor takes them: AdamW's defaults hold a key
    (``decoupled_weight_decay``) its constructor refuses."""
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
