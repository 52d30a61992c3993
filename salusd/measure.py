"""Measuring a job: persistent bytes, and the ephemeral peak of one whole training iteration.

Persistent bytes are counted exactly from the tensors (parameters, buffers, one gradient per
requires-grad parameter, optimizer state). The iteration peak is estimated before admission by
running the iteration on fake tensors (``FakeTensorMode``: shapes, dtypes and devices but no data,
no real compute) under the same ``StorageTracker`` that measures a real iteration.

What the tracker sees: every tensor storage created by an operator while it is active, at the
dispatcher level, with its exact byte size. It does not see allocator rounding (the CUDA caching
allocator rounds to 512 bytes) nor scratch memory inside kernels (cuBLAS/cuDNN workspaces).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

T = TypeVar("T")


class EstimationError(RuntimeError):
    """The iteration cannot run on fake tensors (e.g. an output shape depends on data)."""


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())


def _params(model: nn.Module, optimizer: Optimizer | None) -> list[Tensor]:
    groups = optimizer.param_groups if optimizer is not None else []
    return _unique([*model.parameters(), *(p for g in groups for p in g["params"])])


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
    ``peak_bytes_excluding`` recomputes the peak without chosen storages (e.g. state the
    iteration created that is persistent, not ephemeral). Works for CPU, CUDA and fake tensors;
    frees may come from other threads (the autograd engine's), hence the lock.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        # Storage addresses are reused after a free, so each tracked storage gets its own id.
        self._uid_of: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._events: list[tuple[int, int]] = []
        self._next_uid = 0
        self._active = False
        self.live_bytes = 0
        self.peak_bytes = 0

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
            self._events.append((uid, delta))
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, key: int, uid: int) -> None:
        with self._lock:
            if self._uid_of.get(key) == uid:
                del self._uid_of[key]
            self._record(uid, -self._sizes.pop(uid))

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
                self._record(uid, size - self._sizes[uid])
                self._sizes[uid] = size

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

    def peak_bytes_excluding(self, tensors: Iterable[Tensor]) -> int:
        """Peak live bytes while active, leaving out the (live) storages behind ``tensors``."""
        with self._lock:
            skip = {self._uid_of.get(k) for t in tensors if (k := _storage_key(t)) is not None}
            events = list(self._events)
        live = peak = 0
        for uid, delta in events:
            if uid not in skip:
                live += delta
                peak = max(peak, live)
        return peak


def measure_iteration(fn: Callable[[], T],
                      persistent: Callable[[], Iterable[Tensor]] | None = None) -> tuple[T, int]:
    """Run ``fn`` under a ``StorageTracker``; return ``(result, peak ephemeral bytes)``.

    ``persistent`` names tensors that ``fn`` created but that belong to the job's persistent
    state: on a job's first iteration ``optimizer.step()`` creates the optimizer state lazily;
    pass ``lambda: optimizer_state_tensors(optimizer)`` so it is not counted as ephemeral.
    """
    with StorageTracker() as tracker:
        result = fn()
    excluded = list(persistent()) if persistent is not None else []
    return result, tracker.peak_bytes_excluding(excluded)


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


class _FakeJob:
    """A fake copy of a model and its optimizer: same shapes, dtypes, hyperparameters; no data."""

    def __init__(self, mode: FakeTensorMode, model: nn.Module, optimizer: Optimizer | None,
                 device: torch.device | None) -> None:
        self.fakes: dict[int, Tensor] = {}
        for t in _params(model, optimizer):
            fake = nn.Parameter(self._fake(mode, t, device), requires_grad=t.requires_grad)
            if t.requires_grad:
                fake.grad = torch.zeros_like(fake)
            self.fakes[id(t)] = fake
        for t in _unique(model.buffers()):
            self.fakes[id(t)] = self._fake(mode, t, device)
        # deepcopy consults the memo first, so the copy gets the fake tensors, not clones.
        memo: dict[int, Any] = dict(self.fakes)
        self.model = copy.deepcopy(model, memo)
        self.optimizer = self._fake_optimizer(optimizer) if optimizer is not None else None

    @staticmethod
    def _fake(mode: FakeTensorMode, t: Tensor, device: torch.device | None) -> Tensor:
        if device is None:
            return mode.from_tensor(t.detach())
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    def _fake_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """A shallow copy stepping the fake parameters, with fresh state and no hooks."""
        fake = copy.copy(optimizer)
        fake.state = defaultdict(dict)
        fake.param_groups = []
        for group in optimizer.param_groups:
            params = [self.fakes[id(p)] for p in group["params"]]
            fake_group = {**group, "params": params}
            if "foreach" in group and group["foreach"] is None:
                # torch.optim picks foreach kernels for real device tensors but never for fake
                # ones; decide as it would for the real tensors: their temporaries differ.
                fake_group["foreach"] = not group.get("differentiable", False) and all(
                    p.device.type in _get_foreach_kernels_supported_devices() for p in params)
            fake.param_groups.append(fake_group)
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            if hasattr(fake, hooks):
                setattr(fake, hooks, OrderedDict())
        return fake

    def state_bytes(self, param: Tensor) -> int:
        """Bytes of the state the fake optimizer holds for the real ``param``."""
        assert self.optimizer is not None
        entry = self.optimizer.state.get(self.fakes[id(param)], {})
        return sum(_nbytes(v) for v in entry.values() if isinstance(v, Tensor))


def _run_fake(what: str, fn: Callable[[FakeTensorMode], T]) -> T:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, _PlaceholderScalars():
            return fn(mode)
    except Exception as exc:
        raise EstimationError(f"cannot {what} on fake tensors ({type(exc).__name__}: {exc}); "
                              "rely on the measured first iteration instead") from exc


def persistent_bytes(model: nn.Module, optimizer: Optimizer | None) -> int:
    """Bytes of a job's persistent state, exactly: parameters, buffers, gradients, optimizer state.

    One gradient per requires-grad parameter. Optimizer state is created lazily by the first
    ``step()``; for parameters without state yet it is predicted by stepping a fake copy of the
    optimizer (same class and hyperparameters, fake parameters with zero gradients) under
    ``FakeTensorMode`` and summing the state that step creates. Existing state is counted as is.
    Every tensor counts wherever it lives (a CPU ``step`` counter next to CUDA parameters too).
    """
    params = _params(model, optimizer)
    total = sum(_nbytes(p) for p in params)
    total += sum(_nbytes(b) for b in _unique(model.buffers()))
    total += sum(_nbytes(p) for p in params if p.requires_grad)
    if optimizer is None:
        return total
    total += sum(_nbytes(t) for t in _unique(optimizer_state_tensors(optimizer)))
    stateless = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if stateless:
        def predict(mode: FakeTensorMode) -> int:
            job = _FakeJob(mode, model, optimizer, device=None)
            assert job.optimizer is not None
            job.optimizer.step()
            return sum(job.state_bytes(p) for p in stateless)

        total += _run_fake("predict the optimizer state", predict)
    return total


def estimate_iteration_peak(model: nn.Module, optimizer: Optimizer | None,
                            loss_fn: Callable[..., Tensor], example_inputs: tuple[Tensor, ...],
                            target: Tensor | None = None,
                            device: torch.device | str | None = None) -> int:
    """Peak ephemeral bytes of one whole training iteration, estimated on fake tensors.

    The iteration is ``optimizer.zero_grad(set_to_none=False)``, ``loss = loss_fn(
    model(*inputs), target)`` (``loss_fn(output)`` without a target), ``loss.backward()``,
    ``optimizer.step()``, in steady state: parameters, gradients and optimizer state exist
    before it starts (a fake warm-up step creates the state) and are not counted; activations,
    autograd buffers, gradients before accumulation and optimizer temporaries are. The inputs
    and target are not counted either. ``device`` runs the estimate as if the model lived there
    (default: where its parameters are); it must be available in this process. The real model
    and optimizer are not touched. Raises ``EstimationError`` when the iteration cannot run on
    fake tensors.
    """
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of tensors, got {type(example_inputs)}")
    target_device = torch.device(device) if device is not None else None
    if target_device is not None and target_device.type != "cpu":
        backend = getattr(torch, target_device.type, None)
        # Fake tensors need the device's runtime for backward; without it torch aborts.
        if backend is None or not backend.is_available():
            raise ValueError(f"device {target_device} is not available here; estimate on a "
                             "machine that has it, or leave device unset")

    def estimate(mode: FakeTensorMode) -> int:
        job = _FakeJob(mode, model, optimizer, target_device)
        inputs = tuple(_FakeJob._fake(mode, x, target_device) if isinstance(x, Tensor) else x
                       for x in example_inputs)
        fake_target = (_FakeJob._fake(mode, target, target_device)
                       if isinstance(target, Tensor) else target)
        if job.optimizer is not None:
            job.optimizer.step()
        with StorageTracker() as tracker:
            loss = train_step(job.model, job.optimizer, loss_fn, inputs, fake_target)
            del loss
        return tracker.peak_bytes

    return _run_fake("estimate the iteration", estimate)


def train_step(model: nn.Module, optimizer: Optimizer | None, loss_fn: Callable[..., Tensor],
               inputs: tuple[Any, ...], target: Any = None) -> Tensor:
    """One training iteration as the estimate models it; returns the detached loss."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=False)
    output = model(*inputs)
    loss = loss_fn(output, target) if target is not None else loss_fn(output)
    del output
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


def estimate_forward_peak(model: nn.Module, example_inputs: tuple[Tensor, ...]) -> int:
    """Peak ephemeral bytes of one inference call (`model(*inputs)` under inference mode),
    estimated on fake tensors; the output counts, the inputs do not."""

    def estimate(mode: FakeTensorMode) -> int:
        job = _FakeJob(mode, model, None, None)
        inputs = tuple(_FakeJob._fake(mode, x, None) if isinstance(x, Tensor) else x
                       for x in example_inputs)
        with StorageTracker() as tracker, torch.inference_mode():
            out = job.model(*inputs)
            del out
        return tracker.peak_bytes

    return _run_fake("estimate the inference call", estimate)


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


def held_bytes(objects: Iterable[object]) -> int:
    """Bytes of every distinct tensor storage the objects hold now (no predictions)."""
    seen: dict[int, int] = {}
    for obj in objects:
        for t in _tensors_of(obj):
            key = _storage_key(t)
            if key is not None:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(objects: Iterable[object]) -> int:
    """Bytes of a job's persistent state: every distinct tensor storage its objects hold, one
    gradient per requires-grad parameter that has none yet, and the optimizer state that each
    optimizer's first `step()` will create (predicted on fake tensors, as `persistent_bytes`
    does)."""
    objects = list(objects)
    total = held_bytes(objects)
    for obj in objects:
        if isinstance(obj, nn.Module):
            total += sum(_nbytes(p) for p in obj.parameters() if p.requires_grad and p.grad is None)
        if isinstance(obj, Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            stateless = [p for p in params if p.requires_grad and not obj.state.get(p)]
            if stateless:
                def predict(mode: FakeTensorMode, opt: Optimizer = obj,
                            todo: list[Tensor] = stateless) -> int:
                    job = _FakeJob(mode, nn.ParameterList(), opt, device=None)
                    assert job.optimizer is not None
                    job.optimizer.step()
                    return sum(job.state_bytes(p) for p in todo)

                # Otherwise it is counted once it exists: the first call is measured.
                with contextlib.suppress(EstimationError):
                    total += _run_fake("predict the optimizer state", predict)
    return total


def _fake_state(mode: FakeTensorMode, state: object) -> object:
    """A deep copy of the job's state whose tensors are fake (same shapes, no data); shared
    tensors stay shared and optimizers keep pointing at the copied parameters."""
    memo: dict[int, Any] = {}
    for obj in vars(state).values():
        for t in _tensors_of(obj):
            if id(t) in memo:
                continue
            fake: Tensor = mode.from_tensor(t.detach())
            if isinstance(t, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                if p.grad is not None:
                    memo[id(p)].grad = memo[id(p.grad)]
    return copy.deepcopy(state, memo)


def estimate_call_peak(fn: Callable[..., Any], state: object, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> int:
    """Peak ephemeral bytes of `fn(state, *args, **kwargs)`, estimated by running it on fake
    copies of the state and arguments (no data, no real compute). When an optimizer holds no
    state yet, the call first runs once untracked so that the measured run is in steady state.
    The real state is not touched. Raises EstimationError when the call cannot run on fake
    tensors (data-dependent control flow, objects that cannot be copied)."""

    def estimate(mode: FakeTensorMode) -> int:
        fake = _fake_state(mode, state)
        fargs, fkwargs = tree_map_only(Tensor, lambda t: mode.from_tensor(t), (args, kwargs))
        if any(isinstance(o, Optimizer) and not o.state for o in vars(fake).values()):
            fn(fake, *fargs, **fkwargs)
        with StorageTracker() as tracker:
            out = fn(fake, *fargs, **fkwargs)
            del out
        return tracker.peak_bytes

    return _run_fake("estimate the call", estimate)


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
