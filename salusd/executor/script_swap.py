"""`suspend --swap` of a script job: what the executor can reach of a running script's state.

A script's tensors are its own, in its local variables; the executor knows only the
optimizers its step hook saw (`boundaries.py`). From those it reaches their parameters,
gradients and state, and the modules that own those parameters (found among the live objects:
each module with a parameter of its own that an optimizer steps), with their buffers. The swap
moves exactly those to host memory at a boundary, in place (`state_move.relocate`, so the
script's references stay valid), and moves each back to the device it came from when the job
is placed again. What it cannot reach it leaves, and says so: tensors of modules no optimizer
steps (a frozen teacher, a parent's own buffers), and on a GPU the device bytes still allocated
after the move (batches, activations, anything else the script holds). On the CPU every tensor
is in host memory already: nothing moves, and the bookkeeping is the same.

A swap that would leave the script wrong is refused, with the reason, and moves nothing
(`unsafe`): a live tensor outside what is moved that shares a moved storage (a view of a
parameter kept in a local) would go on reading and writing the old device copy, and a CUDA
graph replays kernels on the addresses it was captured with.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from salus.daemon.executor.state_move import destinations, relocate

_HOST = torch.device("cpu")
NOTE = ("tensors outside the stepped optimizers and the modules owning their parameters "
        "(batches, locals, modules no optimizer steps) are not reached")


class ScriptSwap:
    """The script's reachable state, and where each of its tensors lived before a swap."""

    def __init__(self) -> None:
        self.home: list[tuple[Tensor, torch.device]] = []

    def out(self, optimizers: Iterable[Optimizer]) -> dict[str, int | str | None]:
        """Move what the optimizers reach to host memory: counts and bytes reached, moved and
        left (bytes)."""
        optimizers = list(optimizers)
        stepped = {id(p) for opt in optimizers for group in opt.param_groups
                   for p in group["params"]}
        modules = _live_modules()
        owners = [m for m in modules
                  if any(id(p) in stepped for p in m.parameters(recurse=False))]
        found = destinations([*optimizers, *owners], _HOST)
        if any(t.device != _HOST for t, _ in found):
            why = unsafe([t for t, _ in found], gc.get_objects())
            if why is not None:
                return {"refused": why, "moved_bytes": 0, "note": NOTE}
        self.home = [(t, t.device) for t, _ in found]
        moved = relocate([(t, _HOST) for t, where in self.home if where != _HOST])
        reached = {id(t) for t, _ in found}
        left = [t for m in modules for t in (*m.parameters(recurse=False),
                                             *m.buffers(recurse=False)) if id(t) not in reached]
        left_modules = sum(1 for m in modules if any(
            id(t) not in reached for t in (*m.parameters(recurse=False),
                                           *m.buffers(recurse=False))))
        device_left = None
        if any(where.type == "cuda" for _, where in self.home) and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            device_left = torch.cuda.memory_allocated()
        return {"optimizers": len(optimizers), "modules": len(owners), "tensors": len(found),
                "bytes": _storage_bytes(t for t, _ in found), "moved_bytes": moved,
                "left_modules": left_modules, "left_tensors": len(left),
                "left_bytes": _storage_bytes(left), "device_bytes_left": device_left,
                "note": NOTE}

    def back(self) -> dict[str, int | str | None]:
        """Move every tensor the last `out` moved back where it was: the bytes moved."""
        moves = [(t, where) for t, where in self.home if t.device != where]
        self.home = []
        return {"moved_back_bytes": relocate(moves)}


def unsafe(moved: list[Tensor], live: Iterable[object]) -> str | None:
    """Why moving the tensors `moved` in place would leave the script wrong, among the `live`
    objects (the process's, from the collector), or None: another tensor that shares one of
    their storages, or a captured CUDA graph."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    storages = {t.untyped_storage()._cdata for t in moved}
    ours = {id(t) for t in moved}
    aliases = 0
    for obj in live:
        if graph is not None and isinstance(obj, graph):
            return ("the script holds a captured CUDA graph, which would replay on the "
                    "device addresses it was captured with")
        if isinstance(obj, Tensor) and id(obj) not in ours and obj.layout == torch.strided:
            try:
                aliases += obj.untyped_storage()._cdata in storages
            except (NotImplementedError, RuntimeError):  # no storage of its own
                continue
    if aliases:
        return (f"{aliases} live tensor(s) outside the optimizers' reach share storage with "
                "what would move (views of parameters or optimizer state), and would keep "
                "using the device copy")
    return None


def _live_modules() -> list[nn.Module]:
    """Every module object alive in the process (modules are tracked by the collector)."""
    return [obj for obj in gc.get_objects() if isinstance(obj, nn.Module)]


def _storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())

