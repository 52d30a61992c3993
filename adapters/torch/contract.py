"""The checks that keep a port written the obvious way from going silently wrong: a module that
keeps layers where `state_dict()` cannot see them is refused at attach; an attached LR
scheduler stepped or optimizer given another learning rate on the client is refused at the next
call or pull, and a module changed on the client (run in train mode, stepped) at the next pull,
since salusd holds its own copy of each and the pull would overwrite the client's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, hooks


def check_registered(objects: dict[str, Any]) -> None:
    """Raise TypeError naming the first attribute of an attached module that holds modules or
    parameters, not registered anywhere in it, in a plain list, tuple, set or dict (or a
    tensor that requires grad and is neither a parameter nor a buffer): `state_dict()` leaves
    them out, so `pull()` could not bring back what the job did to them."""
    for name, obj in objects.items():
        if not isinstance(obj, nn.Module):
            continue
        # Registered ones held in a plain list too (an LSTM's _flat_weights) are fine.
        registered = {id(t) for t in (*obj.modules(), *obj.parameters(), *obj.buffers())}
        for prefix, module in obj.named_modules(prefix=name):
            for attr, value in vars(module).items():
                if attr in _MODULE_INTERNALS:
                    continue
                where = f"{prefix}.{attr}"
                if (isinstance(value, torch.Tensor) and value.requires_grad
                        and id(value) not in registered):
                    raise TypeError(
                        f"{where} is a tensor that requires grad but is neither a parameter "
                        "nor a buffer, so state_dict() leaves it out and pull() could not "
                        "bring back what the job does to it: make it an nn.Parameter (or "
                        "register_buffer it)")
                if isinstance(value, list | tuple | set | dict) and any(
                        isinstance(v, nn.Module | nn.Parameter) and id(v) not in registered
                        for v in _contents(value)):
                    container = ("nn.ModuleDict / nn.ParameterDict" if isinstance(value, dict)
                                 else "nn.ModuleList / nn.ParameterList")
                    raise TypeError(
                        f"{where} is a plain {type(value).__name__} holding modules or "
                        "parameters: they are not in state_dict() (nor in parameters()), so "
                        f"pull() could not bring them back; use {container} instead")


def _contents(value: Any, depth: int = 0) -> Iterator[Any]:
    """The items of nested plain containers (a few levels deep)."""
    items = value.values() if isinstance(value, dict) else value
    for item in items:
        if isinstance(item, list | tuple | set | dict) and depth < 3:
            yield from _contents(item, depth + 1)
        else:
            yield item


class ClientChanges:
    """The attached objects as the job last had them: optimizers by their learning rates, LR
    schedulers by `last_epoch`, modules by the version counters of their buffers (a forward
    in train mode bumps batch norm's `num_batches_tracked`) and parameters (summed). A change
    on the client is one the job never sees, and the next `pull()` would overwrite it."""

    def __init__(self, objects: dict[str, Any]) -> None:
        # Schedulers first: a scheduler's step also changes its optimizer's learning rates.
        self.objects = {name: obj for kind in (LRScheduler, torch.optim.Optimizer, nn.Module)
                        for name, obj in objects.items() if isinstance(obj, kind)}
        # A module's tensors, listed at attach and at each pull (its tree is not walked again).
        self.tensors: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.marks: dict[str, tuple[float, ...]] = {}
        self.resync(list(self.objects))

    def check(self, modules: bool = False) -> None:
        """Raise RuntimeError for the first object changed on the client (once: every object
        is marked as it is now, so a caller that catches the error can go on). Modules are
        compared only with `modules` (at a pull, which would overwrite them): reading the
        version counters of a model's tensors costs tens of microseconds, too much for every
        call."""
        for name, obj in self.objects.items():
            if isinstance(obj, nn.Module) and not modules:
                continue
            mark, now = self.marks[name], self._mark(name)
            if now != mark:
                self.resync(list(self.objects))
                raise RuntimeError(_changed(name, obj, mark, now))

    def resync(self, names: list[str]) -> None:
        """The client's objects `names` were just loaded with the job's state."""
        for name in names:
            obj = self.objects.get(name)
            if isinstance(obj, nn.Module):
                self.tensors[name] = (list(obj.buffers()), list(obj.parameters()))
            if obj is not None:
                self.marks[name] = self._mark(name)

    def _mark(self, name: str) -> tuple[float, ...]:
        obj = self.objects[name]
        if isinstance(obj, torch.optim.Optimizer):
            return tuple([float(group["lr"]) for group in obj.param_groups])
        if isinstance(obj, nn.Module):
            buffers, weights = self.tensors[name]
            return (float(sum(t._version for t in buffers) + sum(t._version for t in weights)),)
        return (float(obj.last_epoch),)


def _changed(name: str, obj: Any, before: tuple[float, ...], now: tuple[float, ...]) -> str:
    kind = type(obj).__name__
    if isinstance(obj, torch.optim.Optimizer):
        what = f"its learning rates changed on the client ({list(before)} -> {list(now)})"
        fix = (f"remote.call(lambda s: s.{name}.param_groups[0].update(lr=...)), or step the "
               "attached LR scheduler in the job")
    elif isinstance(obj, nn.Module):
        what = ("its buffers or parameters were written on the client (a forward in train "
                "mode updates batch norm's running statistics; an optimizer step its weights)")
        fix = (f"run it in the job (remote.call(lambda s, x: s.{name}(x), x)), or in eval "
               f"mode here ({name}.eval()) where only its outputs are needed")
    else:
        what = f"it was stepped on the client (last_epoch {before[0]:g} -> {now[0]:g})"
        fix = f"remote.call(lambda s: s.{name}.step())"
    return (f"attached {name!r} (a {kind}): {what} after attach or the last pull(). salusd "
            "keeps its own copy, so the job never sees this and pull() would overwrite it; "
            f"make the change in the job instead: {fix}")
