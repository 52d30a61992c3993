"""A job's persistent tensors living inside an ``Arena``, swappable to host memory and back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .arena import Arena
from .bins import OutOfArenaMemory


@dataclass(eq=False)
class _Slot:
    """One persistent tensor: where it lives in the arena and how to re-point its owner."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    get: Callable[[], torch.Tensor | None]
    set: Callable[[torch.Tensor], None]
    state_key: tuple[int, str] | None = None
    """``(id(param), key)`` for an optimizer-state entry."""
    is_gradient: bool = False
    offset: int | None = None
    host: torch.Tensor | None = None


def _param_slots(name: str, p: nn.Parameter) -> Iterator[_Slot]:
    def set_data(t: torch.Tensor) -> None:
        p.data = t

    def set_grad(t: torch.Tensor) -> None:
        p.grad = t

    yield _Slot(f"parameter {name}", p.shape, p.dtype, lambda: p.data, set_data)
    if p.requires_grad:
        # A missing gradient becomes zeros: backward then accumulates into the arena.
        yield _Slot(f"gradient {name}", p.shape, p.dtype,
                    lambda: p.grad if p.grad is not None else torch.zeros_like(p), set_grad,
                    is_gradient=True)


def _buffer_slot(name: str, owners: list[tuple[nn.Module, str]], t: torch.Tensor) -> _Slot:
    module, attr = owners[0]

    def set_buffer(new: torch.Tensor) -> None:
        for owner, key in owners:
            setattr(owner, key, new)

    return _Slot(f"buffer {name}", t.shape, t.dtype, lambda: getattr(module, attr), set_buffer)


def _state_slot(name: str, optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str,
                t: torch.Tensor) -> _Slot:
    # Look the entry up each time: load_state_dict replaces optimizer.state wholesale.
    def set_state(new: torch.Tensor) -> None:
        optimizer.state[p][key] = new

    def get_state() -> torch.Tensor | None:
        value = optimizer.state.get(p, {}).get(key)
        return value if isinstance(value, torch.Tensor) else None

    return _Slot(f"optimizer state {name}.{key}", t.shape, t.dtype, get_state, set_state,
                 state_key=(id(p), key))


def _unique_params(model: nn.Module, optimizer: torch.optim.Optimizer | None
                   ) -> list[tuple[str, nn.Parameter]]:
    params: dict[int, tuple[str, nn.Parameter]] = {
        id(p): (name, p) for name, p in model.named_parameters()}
    for g, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
        for i, p in enumerate(group["params"]):
            params.setdefault(id(p), (f"optimizer.group{g}.param{i}", p))
    return list(params.values())


def _buffers(model: nn.Module) -> Iterator[_Slot]:
    owners: dict[int, tuple[str, torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, t in module.named_buffers(recurse=False):
            entry = owners.setdefault(id(t), (f"{prefix}.{attr}".lstrip("."), t, []))
            if (module, attr) not in entry[2]:
                entry[2].append((module, attr))
    for name, t, where in owners.values():
        yield _buffer_slot(name, where, t)


class ResidentState:
    """A job's persistent tensors (parameters, gradients, buffers, optimizer state) as arena views.

    The module and optimizer keep their own objects: parameters are re-pointed with
    ``p.data = view`` and ``p.grad = view``, buffers with ``setattr`` and optimizer state by
    replacing the entries of ``optimizer.state``. Every requires-grad parameter gets a zeroed
    gradient view, so train with ``optimizer.zero_grad(set_to_none=False)``: backward then
    accumulates into the arena. (A parameter that never receives a gradient therefore sees a
    zero gradient rather than ``None``.) Views are contiguous; other layouts are not kept.

    On a non-CPU arena, 0-dim optimizer state on the CPU (the ``step`` counters of Adam and
    friends when not ``capturable``) stays on the CPU, where torch.optim expects it; everything
    else moves into the arena. On a CPU arena every tensor moves in.
    """

    def __init__(self, arena: Arena, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
        """Use ``ResidentState.place``; this constructor places nothing."""
        self.arena = arena
        self.model = model
        self.optimizer = optimizer
        self._slots: list[_Slot] = []
        self._swapped = False
        self._released = False

    @classmethod
    def place(cls, arena: Arena, model: nn.Module,
              optimizer: torch.optim.Optimizer | None) -> ResidentState:
        """Copy the job's persistent tensors into ``arena`` and point the job at the views.

        Nothing changes if the arena runs out: the chunks taken so far are freed and
        ``OutOfArenaMemory`` propagates.
        """
        state = cls(arena, model, optimizer)
        slots = [s for name, p in _unique_params(model, optimizer) for s in _param_slots(name, p)]
        slots.extend(_buffers(model))
        slots.extend(state._new_state_slots()[0])
        state._fill(slots, state._allocate(slots))
        state._slots = slots
        return state

    @property
    def nbytes(self) -> int:
        """Bytes this job holds in the arena (aligned chunk sizes; 0 while swapped out)."""
        return sum(self.arena.size_of(s.offset) for s in self._slots
                   if s.offset is not None)

    @property
    def swapped(self) -> bool:
        """Whether the tensors currently live in host memory instead of the arena."""
        return self._swapped

    def _check_usable(self, action: str, swapped: bool = False) -> None:
        if self._released:
            raise ValueError(f"cannot {action}: the state was released")
        if self._swapped != swapped:
            where = "swapped out" if self._swapped else "resident"
            raise ValueError(f"cannot {action}: the state is {where}")

    def _placeable(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided:
            return False
        # torch.optim keeps non-capturable step counters on the CPU next to device params.
        return self.arena.device.type == "cpu" or t.device.type != "cpu" or t.dim() > 0

    def _new_state_slots(self) -> tuple[list[_Slot], list[_Slot]]:
        """Slots for state entries not yet in the arena, and the slots they replace."""
        if self.optimizer is None:
            return [], []
        held = {s.state_key: s for s in self._slots if s.state_key is not None}
        names = {id(p): name for name, p in _unique_params(self.model, self.optimizer)}
        new, replaced = [], []
        for p, entries in self.optimizer.state.items():
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor) or not self._placeable(value):
                    continue
                old = held.get((id(p), key))
                if old is not None and self.arena.owns(value):
                    continue
                new.append(_state_slot(names.get(id(p), "?"), self.optimizer, p, key, value))
                if old is not None:
                    replaced.append(old)
        return new, replaced

    def _allocate(self, slots: list[_Slot]) -> list[int]:
        offsets: list[int] = []
        for slot in slots:
            nbytes = slot.shape.numel() * slot.dtype.itemsize
            try:
                offsets.append(self.arena.alloc(max(nbytes, 1)))
            except OutOfArenaMemory as exc:
                for offset in offsets:
                    self.arena.free(offset)
                exc.add_note(f"while placing {slot.name} ({len(offsets)} of {len(slots)} "
                             "tensors placed, now released again)")
                raise
        return offsets

    def _sync(self) -> None:
        if self.arena.device.type == "cuda":
            torch.cuda.current_stream(self.arena.device).synchronize()

    def _fill(self, slots: list[_Slot], offsets: list[int]) -> None:
        """Copy each slot's host copy (or current tensor) into its chunk and re-point the owner."""
        non_blocking = self.arena.device.type == "cuda"
        views: list[torch.Tensor | None] = []
        for slot, offset in zip(slots, offsets, strict=True):
            view = self.arena.view(offset, slot.shape, slot.dtype)
            source = slot.host if slot.host is not None else slot.get()
            if source is not None:
                view.copy_(source.detach(), non_blocking=non_blocking)
            slot.offset = offset
            views.append(view if source is not None else None)
        self._sync()
        for slot, placed in zip(slots, views, strict=True):
            slot.host = None
            if placed is not None:
                slot.set(placed)

    def _evict(self, pinned: bool) -> None:
        """Copy every slot to host memory, point the owners there and free the chunks."""
        hosts = []
        for slot in self._slots:
            current = slot.get()
            host = None
            if current is not None:
                host = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=pinned)
                host.copy_(current.detach(), non_blocking=pinned)
            hosts.append(host)
        self._sync()
        for slot, host in zip(self._slots, hosts, strict=True):
            if host is not None:
                slot.set(host)
            slot.host = host
            self._free_slot(slot)

    def _free_slot(self, slot: _Slot) -> None:
        if slot.offset is not None:
            self.arena.free(slot.offset)
            slot.offset = None

    def adopt_optimizer_state(self) -> None:
        """Move optimizer state created since placement (lazily, by the first ``step()``) in.

        Values are copied and the ``optimizer.state`` entries replaced by arena views. Call it
        after the first step; later calls are cheap and adopt only what is new. Raises
        ``OutOfArenaMemory`` (and changes nothing) if the arena is full.
        """
        self._check_usable("adopt optimizer state")
        new, replaced = self._new_state_slots()
        self._fill(new, self._allocate(new))
        for slot in replaced:
            self._free_slot(slot)
        self._slots = [s for s in self._slots if s not in replaced] + new

    def adopt_gradients(self) -> None:
        """Copy gradients that left the arena back into their chunks and re-point ``p.grad``.

        Gradients leave when something replaces them, e.g. ``zero_grad(set_to_none=True)``
        followed by ``backward()``; a ``None`` gradient comes back as zeros.
        """
        self._check_usable("adopt gradients")
        for slot in self._slots:
            current = slot.get()
            if slot.is_gradient and current is not None and not self.arena.owns(current):
                assert slot.offset is not None
                view = self.arena.view(slot.offset, slot.shape, slot.dtype)
                view.copy_(current.detach())
                slot.set(view)

    def swap_out(self) -> None:
        """Copy every tensor to host memory (pinned for a CUDA arena) and free the chunks."""
        self._check_usable("swap out")
        self._evict(pinned=self.arena.device.type == "cuda")
        self._swapped = True

    def swap_in(self) -> None:
        """Allocate again (offsets may differ), copy back and re-point; values are identical.

        Raises ``OutOfArenaMemory`` (and stays swapped out) if the arena is too full.
        """
        self._check_usable("swap in", swapped=True)
        self._fill(self._slots, self._allocate(self._slots))
        self._swapped = False

    def release(self) -> None:
        """Free every chunk for good; the module and optimizer keep working on host copies."""
        if self._released:
            return
        if not self._swapped:
            self._evict(pinned=False)
        self._slots = []
        self._released = True
