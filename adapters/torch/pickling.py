"""Pickling what a job ships: by value where the executor could not import it, and an error
that names an attached object that cannot be pickled."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from typing import Any

import cloudpickle
import torch

from salus.daemon.wire.channel import Pickled

_INSTALLED = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def _register_by_value(obj: Any) -> None:
    """Have cloudpickle send by value the classes and functions that the executor could not
    import: those of `__mp_main__` and of modules outside installed packages (the script's
    folder). `__main__` is sent by value by cloudpickle already."""
    seen: set[int] = set()
    stack = [obj]
    names: set[str] = set()
    while stack and len(seen) < 100_000:
        item = stack.pop()
        if id(item) in seen or isinstance(item, str | bytes | int | float | torch.Tensor):
            continue
        seen.add(id(item))
        names.add(getattr(type(item), "__module__", "") or "")
        if callable(item):
            names.add(getattr(item, "__module__", "") or "")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set):
            stack.extend(item)
        elif isinstance(item, functools.partial):
            stack.extend((item.func, *item.args, *item.keywords.values()))
        elif hasattr(item, "__dict__") and not isinstance(item, type | types.ModuleType):
            stack.extend(vars(item).values())
    for name in names:
        module = sys.modules.get(name)
        if module is None or name in ("__main__", "builtins") or name.startswith(
                ("salus.", "torch")):
            continue
        path = getattr(module, "__file__", None)
        if name == "__mp_main__" or (path and not os.path.realpath(path).startswith(
                _INSTALLED)):
            cloudpickle.register_pickle_by_value(module)


def pickled(obj: Any, what: str = "attached objects") -> Pickled:
    """`obj` to be pickled when its request is sent (by value where the executor could not
    import it)."""
    _register_by_value(obj)
    return Pickled(obj, what)


def unpicklable(objects: dict[str, Any], exc: Exception) -> TypeError:
    """The error for attached objects that cannot be pickled: which one, and what to do."""
    culprit = ""
    for name, value in objects.items():
        try:
            cloudpickle.dumps(value)
        except Exception:
            culprit = f" {name!r} (a {type(value).__name__})"
            break
    return TypeError(f"cannot send the attached object{culprit} to salusd: {exc}. Make it "
                     "picklable (e.g. define __getstate__), or create it inside a "
                     "@remote.function")
