"""Run a function once a module is imported: now when it already is, else right after the
script's own import of it finishes.

A script job's executor in an environment without torch (or one whose script imports torch
only later) must not import torch itself: what it does to torch (the optimizer-step
boundary, the intra-op thread count, the device cap) waits until the script imports it. A
finder first on `sys.meta_path` watches the names asked for; it finds each module with the
finders after it and wraps the loader only for the module's execution, so the module keeps
its own loader and spec.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

log = logging.getLogger("salusd.executor")
Action = Callable[[ModuleType], None]
_waiting: dict[str, list[Action]] = {}
_lock = threading.RLock()


def when_imported(name: str, action: Action) -> None:
    """Call `action(module)` with module `name` once it is imported: at once if it is."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(action)
            if not any(isinstance(f, _Watcher) for f in sys.meta_path):
                sys.meta_path.insert(0, _Watcher())
            return
    _run(action, module)


def _run(action: Action, module: ModuleType) -> None:
    """Run `action`: one that fails is logged and leaves the script's import as it was."""
    try:
        action(module)
    except Exception:
        log.exception("after importing %s", module.__name__)


def imported(name: str) -> ModuleType | None:
    """Module `name` if this process imported it (None: not yet), without importing it."""
    return sys.modules.get(name)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders, to run their actions after them."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the waiting actions; the module keeps its own loader."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        module.__loader__ = self.inner
        self.inner.exec_module(module)
        with _lock:
            actions = _waiting.pop(self.name, [])
            if not _waiting:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Watcher)]
        for action in actions:
            _run(action, module)

    def __getattr__(self, name: str) -> object:  # resources, source: the module's own loader
        return getattr(self.inner, name)

