"""A job's memory, counted inside its executor: its persistent bytes, and a call's estimated peak.

`state_bytes` counts a job's persistent state exactly: every distinct tensor storage its objects
hold, one gradient per requires-grad parameter that has none yet, and the optimizer state that
each optimizer's first ``step()`` will create (from the layout of SGD, Adam and AdamW, else
predicted by stepping a fake copy: `optimizer_state.py`). Before a job's
first call is admitted, `estimate_call_peak` runs the user's function on fake copies of the
state and arguments (``FakeTensorMode``: shapes, dtypes and devices but no data, no real
compute) under a `StorageTracker`; real calls' peaks are measured by `peak.PeakMeter` (on a
CUDA device by `cuda_call.CudaCall`). The zygote calls `warm_up` once, so that forked executors
find this machinery initialised.

What the tracker sees: every tensor storage created by an operator while it is active, at the
dispatcher level, with its exact byte size. It does not see scratch memory inside kernels
(cuBLAS/cuDNN workspaces). Both figures also come in the CUDA caching allocator's reserved
bytes (`Footprint.reserved_bytes`, `salusd/memory/reserve.py`), which is what a CUDA device's
ledger books and what `set_per_process_memory_fraction` caps: the state's tensors as if
allocated together in order, the call's storages replayed in the order the tracker saw them
created and freed.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from salus.daemon.executor.optimizer_state import layout_sizes
from salus.daemon.executor.state_move import destinations
from salus.daemon.memory.reserve import peak_reserved, reserved_for

T = TypeVar("T")


class EstimationError(RuntimeError):
    """The iteration cannot run on fake tensors (e.g. an output shape depends on data)."""


class Footprint(NamedTuple):
    """Device memory in two units: exact tensor `bytes`, and the `reserved_bytes` the CUDA
    caching allocator would reserve for them."""

    bytes: int
    reserved_bytes: int


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())


def optimizer_state_tensors(optimizer: Optimizer | None) -> list[Tensor]:
    """Every tensor held in ``optimizer.state`` (momentum, moments, step counters)."""
    if optimizer is None:
        return []
    return [v for entry in optimizer.state.values() for v in entry.values()
            if isinstance(v, Tensor)]


def _storage_key(t: Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return None


class StorageTracker(TorchDispatchMode):
    """Dispatch mode that records every tensor storage created while it is active (bytes).

    Frees are seen through ``weakref.finalize`` on the storage, also after the mode exits, so
    ``live_bytes`` stays current. ``peak_bytes`` is the largest ``live_bytes`` while active;
    ``events`` the storages' sizes while active, in order (``(id, bytes)``, 0 bytes: freed),
    for `reserve.peak_reserved`.
    Works for CPU, CUDA and fake tensors; frees may come from other threads (the autograd
    engine's), hence the lock.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        # Storage addresses are reused after a free, so each tracked storage gets its own id.
        self._uid_of: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._next_uid = 0
        self._active = False
        self.live_bytes = 0
        self.peak_bytes = 0
        self.events: list[tuple[int, int]] = []

    def __enter__(self) -> StorageTracker:
        self._active = True
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._active = False

    def _record(self, uid: int, delta: int) -> None:
        self.live_bytes += delta
        if self._active:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.events.append((uid, self._sizes.get(uid, 0)))

    def _freed(self, key: int, uid: int) -> None:
        with self._lock:
            if self._uid_of.get(key) == uid:
                del self._uid_of[key]
            self._record(uid, -self._sizes.pop(uid))  # popped first: recorded as 0 bytes

    def _see(self, t: Tensor, inputs: set[int]) -> None:
        key = _storage_key(t)
        if key is None:
            return
        storage = t.untyped_storage()
        size = storage.nbytes()
        with self._lock:
            uid = self._uid_of.get(key)
            if uid is None:
                if key in inputs:
                    return  # an alias of a storage that existed before
                uid = self._uid_of[key] = self._next_uid
                self._next_uid += 1
                self._sizes[uid] = size
                weakref.finalize(storage, self._freed, key, uid)
                self._record(uid, size)
            elif self._sizes[uid] != size:  # resized in place (out= arguments)
                old, self._sizes[uid] = self._sizes[uid], size
                self._record(uid, size - old)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {k for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
                  if (k := _storage_key(t)) is not None}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._see(t, inputs)
        return out

class _PlaceholderScalars(TorchDispatchMode):
    """Reads data-dependent scalars of fake tensors as 1 / 1.0 / False.

    Fake tensors hold no values, so ``Tensor.item()`` or ``bool(t)`` cannot be answered; memory
    does not depend on these values except through branches, which follow the placeholder.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            dtype = args[0].dtype
            if dtype == torch.bool:
                return False
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def _run_fake(what: str, fn: Callable[[FakeTensorMode], T]) -> T:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, _PlaceholderScalars():
            return fn(mode)
    except Exception as exc:
        raise EstimationError(f"cannot {what} on fake tensors ({type(exc).__name__}: {exc}); "
                              "rely on the measured first iteration instead") from exc


def _tensors_of(obj: object) -> list[Tensor]:
    """The tensors a job object holds: a module's parameters, their gradients and buffers; an
    optimizer's state; a tensor itself; the tensors in an object's `state_dict()`."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        params = list(obj.parameters())
        return [*params, *(p.grad for p in params if p.grad is not None), *obj.buffers()]
    if isinstance(obj, Optimizer):
        return optimizer_state_tensors(obj)
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and not isinstance(obj, type):
        try:
            return [t for t in tree_leaves(state_dict()) if isinstance(t, Tensor)]
        except Exception:
            return []
    return []


def _held_sizes(objects: Iterable[object]) -> list[int]:
    """Bytes of each distinct tensor storage the objects hold now, in the order they hold them."""
    seen: dict[int, int] = {}
    for obj in objects:
        for t in _tensors_of(obj):
            key = _storage_key(t)
            if key is not None:
                seen[key] = t.untyped_storage().nbytes()
    return list(seen.values())


def held_bytes(objects: Iterable[object]) -> int:
    """Bytes of every distinct tensor storage the objects hold now (no predictions)."""
    return sum(_held_sizes(objects))


def _fake_optimizer(mode: FakeTensorMode, optimizer: Optimizer) -> tuple[Optimizer,
                                                                          dict[int, Tensor]]:
    """A shallow copy of `optimizer` stepping fake copies of its parameters (zero gradients),
    with fresh state and no hooks; and the fake parameter of each real one, by id."""
    fakes: dict[int, Tensor] = {}
    for t in _unique(p for g in optimizer.param_groups for p in g["params"]):
        fake = nn.Parameter(mode.from_tensor(t.detach()), requires_grad=t.requires_grad)
        if t.requires_grad:
            fake.grad = torch.zeros_like(fake)
        fakes[id(t)] = fake
    copied = copy.copy(optimizer)
    copied.state = defaultdict(dict)
    copied.param_groups = []
    for group in optimizer.param_groups:
        params = [fakes[id(p)] for p in group["params"]]
        fake_group = {**group, "params": params}
        if "foreach" in group and group["foreach"] is None:
            # torch.optim picks foreach kernels for real device tensors but never for fake
            # ones; decide as it would for the real tensors: their temporaries differ.
            fake_group["foreach"] = not group.get("differentiable", False) and all(
                p.device.type in _get_foreach_kernels_supported_devices() for p in params)
        copied.param_groups.append(fake_group)
    for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if hasattr(copied, hooks):
            setattr(copied, hooks, OrderedDict())
    return copied, fakes


def _predicted_optimizer_state(optimizer: Optimizer, params: list[Tensor]) -> list[int]:
    """Bytes of each tensor of state `optimizer`'s first ``step()`` creates for `params`: from
    its layout where `optimizer_state` knows it (SGD, Adam, AdamW), else by stepping a fake copy
    of it (same class and hyperparameters) under ``FakeTensorMode``."""
    known = layout_sizes(optimizer, params)
    if known is not None:
        return known
    return _fake_optimizer_sizes(optimizer, params)


def _fake_optimizer_sizes(optimizer: Optimizer, params: list[Tensor]) -> list[int]:

    def predict(mode: FakeTensorMode) -> list[int]:
        fake, fakes = _fake_optimizer(mode, optimizer)
        fake.step()
        return [_nbytes(v) for p in params
                for v in fake.state.get(fakes[id(p)], {}).values() if isinstance(v, Tensor)]

    return _run_fake("predict the optimizer state", predict)


def _fake_optimizer_state(optimizer: Optimizer, params: list[Tensor]) -> int:
    return sum(_fake_optimizer_sizes(optimizer, params))


def _state_sizes(objects: Iterable[object]) -> list[int]:
    """Bytes of each tensor of a job's persistent state (see `state_bytes`): what it holds,
    then the gradients, then the optimizer state, as a first training step creates them."""
    objects = list(objects)
    sizes = _held_sizes(objects)
    for obj in objects:
        if isinstance(obj, nn.Module):
            sizes += [_nbytes(p) for p in obj.parameters() if p.requires_grad and p.grad is None]
    for obj in objects:
        if isinstance(obj, Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            stateless = [p for p in params if p.requires_grad and not obj.state.get(p)]
            if stateless:
                # Otherwise it is counted once it exists: the first call is measured.
                with contextlib.suppress(EstimationError):
                    sizes += _predicted_optimizer_state(obj, stateless)
    return sizes


def state_bytes(objects: Iterable[object]) -> int:
    """Bytes of a job's persistent state: every distinct tensor storage its objects hold, one
    gradient per requires-grad parameter that has none yet, and the optimizer state that each
    optimizer's first `step()` will create (predicted on fake tensors). Every tensor counts
    wherever it lives (a CPU ``step`` counter next to CUDA parameters too)."""
    return sum(_state_sizes(objects))


def state_footprint(objects: Iterable[object]) -> Footprint:
    """`state_bytes`, and the CUDA caching allocator's reserved bytes for the same tensors
    allocated together in that order (on any device: the state may move to a GPU later)."""
    sizes = _state_sizes(objects)
    return Footprint(sum(sizes), reserved_for(sizes))


def _fake_state(mode: FakeTensorMode, state: object,
                device: torch.device | None = None) -> object:
    """A deep copy of the job's state whose tensors are fake (same shapes, no data); shared
    tensors stay shared and optimizers keep pointing at the copied parameters. With `device`,
    each tensor is faked where placing the state on that device puts it (`state_move`): a
    fake CUDA tensor needs no CUDA, so autocast and kernels choose as they will on the GPU."""
    memo: dict[int, Any] = {}
    where = ({} if device is None else
             {id(t): d for t, d in destinations(vars(state).values(), device)})
    for obj in vars(state).values():
        for t in _tensors_of(obj):
            if id(t) in memo:
                continue
            fake: Tensor = mode.from_tensor(t.detach())
            if id(t) in where and where[id(t)] != fake.device:
                fake = _moved(fake, where[id(t)])
            if isinstance(t, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                if p.grad is not None:
                    memo[id(p)].grad = memo[id(p.grad)]
    return copy.deepcopy(state, memo)


def estimate_call_peak(fn: Callable[..., Any], state: object, args: tuple[Any, ...],
                       kwargs: dict[str, Any], device: torch.device | None = None) -> Footprint:
    """Peak ephemeral bytes of `fn(state, *args, **kwargs)`, estimated by running it on fake
    copies of the state and arguments (no data, no real compute); its reserved bytes are those
    of a fresh caching allocator replaying the call's storages (the state's segments are
    booked apart, so the call is not counted on their free space). When an optimizer holds no
    state yet, the call first runs once untracked so that the measured run is in steady state.
    The real state is not touched. With `device` (the GPU the job will run on) the state and
    the arguments are faked there, the arguments' copy counted in the call as the executor's
    is. Raises EstimationError when the call cannot run on fake tensors (data-dependent control
    flow, objects that cannot be copied)."""

    def estimate(mode: FakeTensorMode) -> Footprint:
        fake = _fake_state(mode, state, device)
        fargs, fkwargs = tree_map_only(Tensor, lambda t: mode.from_tensor(t), (args, kwargs))
        if any(isinstance(o, Optimizer) and not o.state for o in vars(fake).values()):
            fn(fake, *_on(device, fargs), **_on(device, fkwargs))
        with StorageTracker() as tracker:
            out = fn(fake, *_on(device, fargs), **_on(device, fkwargs))
            del out
        return Footprint(tracker.peak_bytes, peak_reserved(tracker.events))

    return _run_fake("estimate the call", estimate)


def _on(device: torch.device | None, tree: T) -> T:
    """`tree` with its tensors on `device` (None: as they are)."""
    if device is None:
        return tree
    return tree_map_only(Tensor, lambda t: _moved(t, device), tree)


def _moved(fake: Tensor, device: torch.device) -> Tensor:
    """A fake tensor like `fake` on `device` (made, not copied: fakes hold no data, and a
    copy would need torch's CUDA build where a made fake CUDA tensor does not)."""
    if fake.device == device:
        return fake
    return torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=device)


def warm_up() -> None:
    """Run one tiny estimate and state count, as an executor does for each job, so the
    fake-tensor machinery is imported and initialised now (the zygote calls this before it
    forks executors): on a cold start that takes seconds, which the first job's admission
    would otherwise pay."""
    from types import SimpleNamespace

    model = nn.Linear(4, 2)
    state = SimpleNamespace(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))

    def iteration(s: SimpleNamespace, x: Tensor, y: Tensor) -> Tensor:
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        s.opt.step()
        return loss.detach()

    estimate_call_peak(iteration, state, (torch.zeros(2, 4), torch.zeros(2, 2)), {})
    state_bytes(vars(state).values())
    iteration(state, torch.zeros(2, 4), torch.zeros(2, 2))  # a real step: autograd, kernels
