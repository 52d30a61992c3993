"""Whether a failed call left the job's state as it found it, so that it may simply run again.

A contract call is a function of the job's shipped state and its arguments. A call that ran out
of device memory is run again once the daemon has placed the job in a bigger lane, instead of
failing its client, when nothing of the state changed: every parameter, buffer and optimizer
state tensor has the version counter it had before (torch bumps it at every in-place write),
and no gradient was written (one that was cleared, as `zero_grad()` does at the start of a
step, is allowed: clearing again gives the same). The random state is set back by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.optim import Optimizer

from salus.daemon.executor.measure import optimizer_state_tensors


@dataclass(frozen=True)
class Snapshot:
    """The version counters of a job's state tensors (`state`) and of its gradients
    (`grads`, by the parameter's id; a parameter without one is absent)."""

    state: tuple[tuple[int, int], ...]
    grads: dict[int, tuple[int, int]]


def _state_tensors(objects: Iterable[object]) -> tuple[list[Tensor], list[nn.Parameter]]:
    tensors: list[Tensor] = []
    params: list[nn.Parameter] = []
    for obj in objects:
        if isinstance(obj, Tensor):
            tensors.append(obj)
        elif isinstance(obj, nn.Module):
            params += list(obj.parameters())
            tensors += list(obj.buffers())
        elif isinstance(obj, Optimizer):
            tensors += optimizer_state_tensors(obj)
            params += [p for g in obj.param_groups for p in g["params"]]
    return tensors + params, params


def snapshot(objects: Iterable[object]) -> Snapshot:
    """The versions of the state the job's `objects` hold, before a call."""
    tensors, params = _state_tensors(objects)
    return Snapshot(tuple((id(t), t._version) for t in tensors),
                    {id(p): (id(p.grad), p.grad._version) for p in params
                     if p.grad is not None})


def unchanged(before: Snapshot, objects: Iterable[object]) -> bool:
    """Whether the state is as `before` found it (gradients may have been cleared)."""
    after = snapshot(objects)
    if after.state != before.state:
        return False
    return all(before.grads.get(key) == grad for key, grad in after.grads.items())
