"""What torch's objects lose when they are pickled, rebuilt once a job's objects are unpickled,
so that they behave in the executor as they did in the client.

- `torch.optim.LBFGS` keeps its parameters in `_params` and a size cache, set in `__init__`
  and dropped from its pickled state.
- An LR scheduler wraps its optimizer's `step` (to check that the optimizer stepped before the
  scheduler does); the wrapper cannot be pickled, so an unpickled scheduler warned at its first
  step that the optimizer's `step` had been overridden — a warning a direct run never prints,
  which reached the job's output once that went to its client.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch


def rebuild(objects: Iterable[Any]) -> None:
    """Give the job's unpickled `objects` back what pickling dropped (see the module)."""
    for obj in objects:
        if isinstance(obj, torch.optim.LBFGS):
            obj._params = obj.param_groups[0]["params"]
            obj._numel_cache = None
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            _track_step_called(obj.optimizer)


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Wrap `optimizer.step` as `LRScheduler.__init__` does, unless it is wrapped already."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)  # type: ignore[arg-type]

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
