"""Moving everything a job's state holds to another device, in place.

`destinations` finds every tensor of the state and where it belongs; `relocate` points each
tensor at a copy of its data there through `tensor.data`, as `nn.Module.to` moves parameters,
so the tensor stays the same Python object: an optimizer's parameter lists and state keys, a
closure, a dict that holds it all see it moved, and nothing is rebuilt. Tensors that shared a
storage (views, RNN weights flattened into one buffer) share one copy again, at the same offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from salus.daemon.executor.transfer import copy_storages

Copy = Callable[[Sequence[Tensor], torch.device], list[Tensor]]
MAX_DEPTH = 64
_CPU = torch.device("cpu")


def destinations(objects: Iterable[Any], device: torch.device) -> list[tuple[Tensor, torch.device]]:
    """Every tensor the objects hold, once each, with the device it belongs on when the state
    is on `device`:

    - a module's parameters, their gradients and its buffers;
    - an optimizer's parameters (and gradients) and every tensor of its state; a group's
      `step` and tensor hyperparameters (a tensor `lr`) stay on the CPU unless the group is
      fused or capturable, as `torch.optim` keeps them (a device `step` would cost a
      synchronisation per parameter and step);
    - a `torch.amp.GradScaler`'s scale and growth tracker;
    - tensors in dicts, lists, tuples and sets, to a depth of `MAX_DEPTH`.

    Other objects are left as they are (an LR scheduler holds no tensors of its own)."""
    found: dict[int, tuple[Tensor, torch.device]] = {}
    visited: set[int] = set()

    def add(t: Tensor, where: torch.device) -> None:
        found.setdefault(id(t), (t, where))
        if t.grad is not None:
            found.setdefault(id(t.grad), (t.grad, where))

    def walk(obj: Any, where: torch.device, depth: int) -> None:
        if isinstance(obj, Tensor):
            add(obj, where)
            return
        if depth > MAX_DEPTH or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                add(t, where)
        elif isinstance(obj, Optimizer):
            _optimizer(obj, where, depth)
        elif isinstance(obj, torch.amp.GradScaler):
            for name in ("_scale", "_growth_tracker"):
                walk(getattr(obj, name, None), where, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, where, depth + 1)
        elif isinstance(obj, list | tuple | set | frozenset):
            for value in obj:
                walk(value, where, depth + 1)

    def _optimizer(opt: Optimizer, where: torch.device, depth: int) -> None:
        for group in opt.param_groups:
            scalars = where if group.get("fused") or group.get("capturable") else _CPU
            for key, value in group.items():
                if key == "params":
                    for p in value:
                        add(p, where)
                else:
                    walk(value, scalars, depth + 1)
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    walk(value, scalars if key == "step" else where, depth + 1)

    for obj in objects:
        walk(obj, device, 0)
    return list(found.values())


def relocate(moves: Sequence[tuple[Tensor, torch.device]], copy: Copy = copy_storages) -> int:
    """Point each tensor of `moves` at a copy of its data on its destination, in place; the
    storages bound for one device from one device are copied by one `copy(sources, device)`
    call (whole storages as 1-D uint8 tensors). Returns the bytes copied."""
    groups: dict[tuple[torch.device, torch.device], dict[int, tuple[Tensor, list[Tensor]]]] = {}
    for t, where in moves:
        if type(t) not in (Tensor, nn.Parameter) or t.layout != torch.strided or t.is_quantized:
            t.data = t.data.to(where)  # no plain storage to share: moved alone
            continue
        storage = t.untyped_storage()
        by_storage = groups.setdefault((t.device, where), {})
        if storage._cdata not in by_storage:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            by_storage[storage._cdata] = (whole, [])
        by_storage[storage._cdata][1].append(t)
    moved = 0
    for (_, where), by_storage in groups.items():
        entries = list(by_storage.values())
        copies = copy([whole for whole, _ in entries], where)
        for (whole, tensors), new in zip(entries, copies, strict=True):
            moved += whole.numel()
            storage = new.untyped_storage()
            for t in tensors:
                t.data = torch.empty(0, dtype=t.dtype, device=new.device).set_(
                    storage, t.storage_offset(), t.size(), t.stride())
    return moved


def move_state(objects: Iterable[Any], device: torch.device, copy: Copy = copy_storages) -> int:
    """Move every tensor of the job's objects to where it belongs on `device` (a device with
    its index), in place (see `destinations`, `relocate`), then `.to(device)` each module, for
    modules that rebuild something of their own when moved (an RNN's flat weights). Returns
    the bytes copied."""
    objects = list(objects)
    moves = [(t, where) for t, where in destinations(objects, device) if t.device != where]
    moved = relocate(moves, copy)
    for obj in objects:
        if isinstance(obj, nn.Module):
            obj.to(device)
    return moved
