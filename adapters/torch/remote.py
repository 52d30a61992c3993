"""The job's state in the daemon as the client reaches it: `Remote` defines and calls functions
over it and pulls it back; `RemoteFunction` is one defined function; `per_replica` and `whole`
mark a gang job's arguments."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from salus.adapters.torch.contract import ClientChanges
from salus.adapters.torch.pickling import pickled
from salus.adapters.torch.replies import pickled_result
from salus.adapters.torch.transport import Future
from salus.daemon.wire import compact
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.codec import PickledPayload
from salus.daemon.wire.errors import CallFailed
from salus.daemon.wire.replicas import PerReplica, Whole

if TYPE_CHECKING:
    from salus.adapters.torch.job import Job

F = TypeVar("F", bound=Callable[..., Any])


def per_replica(*values: Any) -> PerReplica:
    """An argument of a gang job's call that gives replica r `values[r]` (one per replica)."""
    return PerReplica(values)


def whole(value: Any) -> Whole:
    """An argument of a gang job's call that every replica gets whole (not split)."""
    return Whole(value)


class Remote:
    """The job's state in the daemon: define functions over it, call them, pull it back."""

    def __init__(self, job: Job, objects: dict[str, Any]) -> None:
        self.job = job
        self.objects = dict(objects)
        self._next_fid = 0
        self.changed = False  # a call may have changed the job's state since the last pull
        self._changes = ClientChanges(self.objects)

    def iteration(self, fn: F) -> RemoteFunction:
        """Decorator: `fn(s, *args, **kwargs)` runs in the daemon, one scheduled iteration per
        call (it counts toward the job's iterations and the scheduler's accounting)."""
        return self._define(fn, "iteration")

    def function(self, fn: F) -> RemoteFunction:
        """Decorator: like `iteration`, scheduled in the job's lane, not counted as one."""
        return self._define(fn, "function")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(s, *args, **kwargs)` once in the daemon (not counted as an iteration)."""
        job = self.job
        self._changes.check()
        self.changed = True
        return job._request(ops.Call(job._require_id(),
                                     pickled((args, kwargs), "call arguments"),
                                     fn=pickled(fn, "function"), rng=job._rng_to_send()),
                            self._decode_result).result()

    def fetch(self, *names: str) -> dict[str, Any]:
        """The daemon-side state of the named objects (all when none are named): a
        `state_dict()` for objects that have one, the tensor or object itself otherwise."""
        job = self.job
        result: dict[str, Any] = job._request(
            ops.Pull(job._require_id(), list(names) or None), pickled_result).result()
        return result

    def pull(self, *names: str) -> dict[str, Any]:
        """Copy the daemon-side state into the client's objects (`load_state_dict` for modules,
        optimizers, schedulers and scalers, `copy_` for tensors; for modules also each
        submodule's train/eval mode and the non-persistent buffers, which `state_dict()`
        leaves out); returns what was fetched (plain objects cannot be updated in place: take
        them from the returned dict). Raises RuntimeError, copying nothing, when an attached
        object was changed on the client since attach or the last pull (see `Job.attach`)."""
        self._changes.check(modules=True)
        job = self.job
        fetched, modules = job._request(
            ops.Pull(job._require_id(), list(names) or None), _pulled).result()
        for name, value in fetched.items():
            obj = self.objects[name]
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(value)
            if isinstance(obj, torch.nn.Module) and name in modules:
                _load_modes(obj, name, modules[name])
        self._changes.resync(list(fetched))
        if set(fetched) == set(self.objects):
            self.changed = False
        return fetched

    def _define(self, fn: Callable[..., Any], kind: str,
                inference: bool = False) -> RemoteFunction:
        """Define `fn` in the job; `inference`: it serves a model and never trains (the
        daemon then places the job in its owner's lane where it can)."""
        if not callable(fn):
            raise TypeError(f"a {type(fn).__name__} is not a function")
        job = self.job
        fid = self._next_fid
        self._next_fid += 1
        job._request(ops.Define(job._require_id(), fid, kind,
                                pickled(fn, f"function {getattr(fn, '__name__', fn)!r}"),
                                inference)).result()
        return RemoteFunction(self, fid, fn, kind)

    def _decode_result(self, reply: Any) -> Any:
        if type(reply) is compact.Message or isinstance(reply, dict) and (
                reply.get("ok") is True or reply.get("code") == CallFailed.code):
            self.job._calls_answered += 1  # the daemon counts it too (`calls_done`)
        if type(reply) is compact.Message:
            tensors = reply.tensors
            if reply.aux & compact.AUX_RNG:
                self.job._rng_back(tensors[-1])
                tensors = tensors[:-1]
            kind = reply.aux & compact.KIND_MASK
            if kind == compact.KIND_TENSOR:
                return tensors[0]
            if kind == compact.KIND_FLOAT:
                return reply.value
            if kind == compact.KIND_NONE:
                return None
            return tuple(tensors)
        if isinstance(reply, dict):  # a failed call hands back what it drew before failing
            rng = reply.get("rng")
            self.job._rng_back(rng if isinstance(rng, torch.Tensor) else None)
        return pickled_result(reply)


def _pulled(reply: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pull's reply: the objects' state and what `state_dict()` leaves out of modules."""
    fetched: dict[str, Any] = pickled_result(reply)
    extra = reply.get("modules") if isinstance(reply, dict) else None
    return fetched, extra.load("modules") if isinstance(extra, PickledPayload) else {}


def _load_modes(module: torch.nn.Module, name: str, extra: dict[str, Any]) -> None:
    """Set the submodules' train/eval flags and non-persistent buffers as the job has them."""
    modules = list(module.modules())
    if len(modules) != len(extra["training"]):
        raise RuntimeError(f"{name!r} has {len(modules)} submodules here and "
                           f"{len(extra['training'])} in the job: pull() cannot match them")
    for sub, training in zip(modules, extra["training"], strict=True):
        sub.training = training
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for key, value in extra["buffers"].items():
            mine = buffers.get(key)
            owner, _, leaf = key.rpartition(".")
            if mine is None:  # registered in the job after attach
                module.get_submodule(owner).register_buffer(leaf, value, persistent=False)
            elif mine.shape == value.shape and mine.dtype == value.dtype:
                mine.copy_(value)
            else:  # the job replaced it (another shape): so does the client
                setattr(module.get_submodule(owner), leaf, value.to(mine.device))


class RemoteFunction:
    """A function of the job, defined in the daemon: call it like the function itself.
    `changes_state` (True unless set otherwise): whether its calls may change the job's state,
    so that closing without `pull()` warns (see `Job.close`)."""

    def __init__(self, remote: Remote, fid: int, fn: Callable[..., Any],
                 kind: str = "function") -> None:
        self.remote = remote
        self.fid = fid
        self.kind = kind
        self.changes_state = True
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "function")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """Send the call and return at once; `.result()` waits for it."""
        remote = self.remote
        job = remote.job
        remote._changes.check()
        remote.changed = remote.changed or self.changes_state
        if self.kind == "iteration":
            _count_iteration(job)
        rng = job._rng_to_send()
        if (job._compact and not kwargs and len(args) < compact.MAX_TENSORS
                and all(type(a) is torch.Tensor for a in args)):
            aux = self.fid
            tensors = args
            if rng is not None:
                aux |= compact.AUX_RNG
                tensors = (*args, rng)
            message: Any = compact.Message(compact.OP_CALL, job._require_id(), tensors, aux)
        else:
            message = ops.Call(job._require_id(), pickled((args, kwargs), "call arguments"),
                               fid=self.fid, rng=rng)
        return job._request(message, remote._decode_result, direct=True)


def _count_iteration(job: Any) -> None:
    """Count an iteration sent; warn once when the job runs past the iterations it declared,
    which SRTF schedules it by (the daemon goes on: an interactive job ends when it closes)."""
    job.iterations_sent += 1
    if job.resumed_from + job.iterations_sent == job.iterations + 1:
        warnings.warn(f"salus job {job.name!r} ran past the {job.iterations} iterations it "
                      "declared: the scheduler plans with that count (SRTF ranks jobs by it); "
                      "declare the real count in salus.connect(iterations=...)", stacklevel=3)
