"""PyTorch adapter: run a script's own iterations, over its own state, inside salusd.

    import salus.adapters.torch as salus

    with salus.connect(name="mnist", iterations=epochs * len(loader)) as job:
        remote = job.attach(model=model, opt=opt, sched=sched)   # shipped once, as they are now

        @remote.iteration                  # one scheduled iteration per call, run in the daemon
        def train(s, data, target):        # s.model, s.opt, s.sched: the daemon-side objects
            s.model.train()
            s.opt.zero_grad()
            loss = F.nll_loss(s.model(data), target)
            loss.backward()
            s.opt.step()
            return loss                    # any pytree; tensors come back on the CPU

        for epoch in range(epochs):
            for data, target in loader:
                loss = train(data, target)
            remote.call(lambda s: s.sched.step())
        remote.pull()                      # daemon state -> model, opt, sched (load_state_dict)

Sugar over the same contract: `job.train_step(model, optimizer, loss_fn)` returns
`step(*inputs, target) -> float`, and `job.inference(model)` returns `infer(*inputs) -> output`.

- **Errors** of the job's own code fail that call only: the client gets the exception (its
  type and message, with the job's traceback lines as a note) and the job keeps its state.
- **Random numbers**: the job continues the client's torch generator and hands it back, so
  what the daemon-side code draws and what the client draws form one stream, in the order of a
  direct run. With `submit()` the client may draw while a call runs; seed a separate generator
  for such draws (a `DataLoader(generator=g)`) if the run must be reproducible.
- **Pickling**: classes and functions of the script, of `__mp_main__` and of modules that are
  not installed packages (the script's folder) travel by value; an object that cannot be
  pickled is named in the error.
- **Pipelining**: `train.submit(...)` returns a `Future` at once, so the client can prepare the
  next batch while the daemon computes; replies come back in the order calls were made.

**Data-parallel jobs**: `salus.connect(name, iterations, devices=N)` opens a gang of N
replicas, one per device, admitted all or nothing. Every call runs on all replicas, as one
scheduled iteration on all their lanes; each tensor argument is split along dim 0 into N
nearly equal parts and replica r gets part r (`salus.per_replica(b0, b1, ...)` passes one value
per replica, `salus.whole(x)` one value to all). Inside, `s.comm` is the gang's communication
service (`s.comm.all_reduce_gradients(s.model)`, `s.comm.sharded_step(s.opt)`, ...). The
objects are attached once and every replica starts from them; the call returns replica 0's
result, and `s.comm.gather_batch(out)` gathers a whole batch's outputs there. Every replica
starts each call from the client's random state, so they draw the same numbers (as DDP ranks
seeded alike do), and the client goes on from replica 0's. A call that raises on every replica
fails that call; one that raises on some replicas only fails the job (their states may differ
now, or the others wait for it in a collective). Calls go through salusd (no direct channel).
`train_step` averages the gradients over the gang and returns the whole batch's mean loss;
`inference` returns the whole batch's outputs.

The daemon is found at `address=` (`unix:///path`), else `$SALUS_ADDRESS`, else the default
socket. Imports only torch, cloudpickle and the wire package of salusd.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import sysconfig
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import cloudpickle
import torch
from torch import nn

from salus.daemon.wire import compact
from salus.daemon.wire.address import connect_unix, default_socket_path, parse_address
from salus.daemon.wire.channel import (
    Channel,
    ConnectionClosed,
    FrameError,
    Pickled,
    PickledPayload,
    reply_result,
)
from salus.daemon.wire.errors import (
    CallFailed,
    DaemonUnavailable,
    JobCancelled,
    JobFailed,
    SalusError,
)
from salus.daemon.wire.frames import VERSION
from salus.daemon.wire.replicas import MAX_REPLICAS, PerReplica, Whole

__all__ = ["CallFailed", "DaemonUnavailable", "Future", "Job", "Remote", "RemoteFunction",
           "connect", "per_replica", "whole"]
F = TypeVar("F", bound=Callable[..., Any])


def connect(name: str, iterations: int, *, address: str | None = None,
            timeout_s: float | None = 10.0, devices: int = 1) -> Job:
    """Open a job called `name` that plans `iterations` iterations in salusd; with `devices`
    N > 1, a data-parallel gang of N replicas (see the module docstring).

    `timeout_s` (seconds) bounds connecting and opening; calls themselves wait as long as the
    daemon's scheduler makes them. While salusd restarts, connecting is retried for about 20 s
    (`SALUS_RECONNECT=0` turns that off).

    After a restart, salusd brings an interactive job back suspended at its last checkpoint and
    hands it to the next `connect()` of the same owner with the same name: `job.resumed_from`
    is then the iteration it stands at (0 for a new job), `job.attach(...)` keeps the restored
    state (the objects passed are not shipped), and the script skips the batches already done.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if type(iterations) is not int or not 1 <= iterations <= 2**53:
        raise ValueError(f"iterations must be an int from 1 to 2**53, got {iterations!r}")
    if type(devices) is not int or not 1 <= devices <= MAX_REPLICAS:
        raise ValueError(f"devices must be an int from 1 to {MAX_REPLICAS}, got {devices!r}")
    path = parse_address(address) if address is not None else default_socket_path()
    sock = _connect_retrying(path, timeout_s)
    job = Job(Channel(sock), name, iterations, path, devices)
    try:
        job._hello()
    except BaseException:
        job._channel.close()
        raise
    sock.settimeout(None)
    return job


RECONNECT_TRIES = 8  # with backoff 0.25 s doubling to 4 s: about 20 s for salusd to come back


def per_replica(*values: Any) -> PerReplica:
    """An argument of a gang job's call that gives replica r `values[r]` (one per replica)."""
    return PerReplica(values)


def whole(value: Any) -> Whole:
    """An argument of a gang job's call that every replica gets whole (not split)."""
    return Whole(value)


def _connect_retrying(path: str, timeout_s: float | None) -> socket.socket:
    """Connect; while salusd is restarting (`$SALUS_RECONNECT`, on by default; `0` turns it
    off) retry a bounded number of times with backoff."""
    tries = RECONNECT_TRIES if os.environ.get("SALUS_RECONNECT", "1") != "0" else 1
    delay = 0.25
    for attempt in range(tries):
        try:
            return connect_unix(path, timeout_s)
        except DaemonUnavailable as exc:
            if attempt == tries - 1 or "permission denied" in str(exc):
                raise
            time.sleep(delay)
            delay = min(4.0, delay * 2)
    raise AssertionError("unreachable")


class _Line:
    """One connection of a job: to the daemon, or straight to the job's executor. Replies on a
    line come in the order of its requests."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.pending: deque[Future] = deque()
        self.broken: BaseException | None = None


class Future:
    """The pending reply of one request on a job's connection."""

    def __init__(self, job: Job, line: _Line, decode: Callable[[Any], Any]) -> None:
        self._job = job
        self._line = line
        self._decode = decode
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        """Wait for the reply and return the call's result (or raise its error)."""
        if not self._done:
            self._job._wait_for(self, self._line)
        if self._error is not None:
            raise self._error
        return self._value

    def _resolve(self, reply: Any) -> None:
        try:
            self._value = self._decode(reply)
        except BaseException as exc:
            self._error = exc
        self._done = True


class Job:
    """A connection to salusd carrying one job; use `connect()` to make one."""

    def __init__(self, channel: Channel, name: str, iterations: int, path: str,
                 devices: int = 1) -> None:
        self._channel = channel
        self._lock = threading.RLock()
        self._line = _Line(channel)
        self._direct: _Line | None = None
        self.name = name
        self.iterations = iterations
        self.devices = devices  # replicas: > 1 for a data-parallel gang
        self.path = path
        self.id: str | None = None
        self.resumed_from = 0  # > 0: salusd restored this job at that iteration (see connect)
        self.owner: str | None = None
        self.threads: int | None = None
        self.remote: Remote | None = None
        self._closed = False
        self._compact = False
        self._rng_synced: torch.Tensor | None = None

    # ---- the contract -----------------------------------------------------------------------
    def attach(self, **objects: Any) -> Remote:
        """Ship the named objects to the job in the daemon, with their current state; returns
        the `Remote` handle to define and call functions over them."""
        if self.remote is not None:
            raise RuntimeError(f"job {self.name!r} already has its state in salusd; open "
                               "another job with salus.connect() for other objects")
        if not objects:
            raise ValueError("attach needs at least one named object, e.g. attach(model=model)")
        payload = _pickled(objects)
        try:
            future = self._request({"op": "attach", "job": self._require_id(),
                                    "objects": payload, "rng": self._rng_to_send()})
        except TypeError as exc:
            self._rng_synced = None
            raise _unpicklable(objects, exc) from exc
        future.result()
        self.remote = Remote(self, objects)
        if self.devices == 1:  # a gang's calls go to all replicas, through salusd
            self._open_direct()
        return self.remote

    def _open_direct(self) -> None:
        """A socket straight to the job's executor for its calls: while the job has its lane
        to itself they skip the daemon (which is told afterwards)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._request({"op": "channel", "job": self._require_id()},
                          fd=theirs.fileno()).result()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._direct = _Line(Channel(ours))

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[..., torch.Tensor]) -> Callable[..., float]:
        """Ship `model`, `optimizer` and `loss_fn`; returns `step(*inputs, target) -> loss`
        which runs `loss_fn(model(*inputs), target)`, backward and `optimizer.step()` in the
        daemon. Train/eval switches of `model` on the client are followed."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(output, target)")
        remote = self.attach(model=model, optimizer=optimizer, loss_fn=loss_fn)
        step = remote.iteration(_train_step)
        modes = _ModeSync(remote, model)

        def run(*batch: Any) -> float:
            if len(batch) < 2:
                raise TypeError("step(*inputs, target) takes the model's inputs and a target")
            modes.sync()
            return float(step(*batch))

        return run

    def inference(self, model: nn.Module, *, train_mode: bool = False) -> Callable[..., Any]:
        """Ship `model`; returns `infer(*inputs) -> output` run in the daemon under
        `torch.inference_mode()` with the model in eval mode (train mode if `train_mode`).
        The output is the model's own pytree (a tensor, tuple, dict or `ModelOutput`)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        remote = self.attach(model=model)
        return remote.iteration(functools.partial(_infer, train_mode=train_mode))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The job's model parameters and buffers now, as CPU tensors (the attached object
        called `model`)."""
        if self.remote is None:
            raise RuntimeError(f"job {self.name!r} has no state in salusd yet")
        state: dict[str, torch.Tensor] = self.remote.fetch("model")["model"]
        return state

    def info(self) -> dict[str, Any]:
        """The daemon's view of the job: state, progress, placement, memory, threads."""
        result: dict[str, Any] = self._request({"op": "info",
                                                "job": self._require_id()}).result()
        return result

    def ping(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request({"op": "ping"}).result()
        return result

    def close(self) -> None:
        """Finish the job in the daemon and close the connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._drain_direct()
                if self.id is not None and self._line.broken is None:
                    self._request({"op": "close", "job": self.id}).result()
            except (DaemonUnavailable, SalusError):
                pass
            finally:
                self._closed = True
                if self._direct is not None:
                    self._direct.channel.close()
                self._channel.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Job(name={self.name!r}, id={self.id!r}, path={self.path!r})"

    # ---- requests ---------------------------------------------------------------------------
    def _hello(self) -> None:
        try:
            reply = self._request({"op": "ping", "max_frame_bytes":
                                   self._channel.max_frame_bytes}).result()
        except DaemonUnavailable:
            # salusd may have refused the connection (over its limit) and closed it before
            # the ping went out: its refusal is still there to read.
            refusal = self._refusal()
            if refusal is not None:
                raise refusal from None
            raise
        if not isinstance(reply, dict) or reply.get("version") != VERSION:
            raise DaemonUnavailable(f"salusd at {self.path} speaks another protocol version "
                                    f"({reply!r}); install matching versions")
        if reply.get("refused"):
            raise DaemonUnavailable(str(reply["refused"]))
        self._channel.peer_max_frame_bytes = int(reply["max_frame_bytes"])
        self.owner = reply.get("owner")
        self._compact = reply.get("compact") == compact.REVISION
        opened = self._request({"op": "open", "name": self.name, "iterations": self.iterations,
                                "cwd": os.getcwd(), "devices": self.devices}).result()
        self.id, self.threads = str(opened["job"]), opened.get("threads")
        self.resumed_from = int(opened.get("resumed_from") or 0)

    def _refusal(self) -> BaseException | None:
        """The error salusd sent before it closed this connection, if it sent one."""
        try:
            reply = self._channel.recv()
        except (ConnectionClosed, FrameError, OSError):
            return None
        try:
            _json_result(reply)
        except SalusError as error:
            return error
        return None

    def _require_id(self) -> str:
        if self.id is None:
            raise RuntimeError(f"job {self.name!r} is not open")
        return self.id

    def _request(self, message: Any, decode: Callable[[Any], Any] | None = None, *,
                 direct: bool = False, fd: int | None = None) -> Future:
        """Send one request, to the daemon or (`direct`) straight to the job's executor; its
        Future resolves when its reply arrives (replies on a line come in order)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"job {self.name!r} is closed")
            line = self._direct if direct and self._direct is not None else self._line
            if line is self._line and self._direct is not None and self._direct.pending:
                self._drain_direct()  # what goes through the daemon follows the calls before
            if line.broken is not None:
                raise line.broken
            future = Future(self, line, decode or _json_result)
            try:
                if fd is None:
                    line.channel.send(message)
                else:
                    line.channel.send_socket(message, fd)
            except (ConnectionClosed, OSError) as exc:
                self._break(line, exc)
                raise line.broken from None  # type: ignore[misc]
            line.pending.append(future)
        return future

    def _wait_for(self, future: Future, line: _Line) -> None:
        with self._lock:
            while not future.done():
                head = line.pending[0]
                try:
                    reply = line.channel.recv()
                except (ConnectionClosed, OSError) as exc:
                    self._break(line, exc)
                    break
                except FrameError as exc:
                    if not exc.recoverable:
                        self._break(line, exc)
                        break
                    reply = _Raise(exc)
                except BaseException:
                    # Interrupted mid-reply: the stream is out of step with the requests.
                    self._break(line, ConnectionError("interrupted while reading a reply"))
                    raise
                line.pending.popleft()
                head._resolve(reply)

    def _drain_direct(self) -> None:
        if self._direct is not None and self._direct.pending:
            self._wait_for(self._direct.pending[-1], self._direct)

    def _break(self, line: _Line, exc: BaseException) -> None:
        """The line is gone: every request still waiting on it fails with the reason."""
        waiting = list(line.pending)
        line.pending.clear()
        line.broken = DaemonUnavailable(f"lost the connection to salusd at {self.path}: {exc}")
        if line is not self._line:
            line.broken = self._why_executor_gone(exc)
        for future in waiting:
            future._resolve(_Raise(line.broken))

    def _why_executor_gone(self, exc: BaseException, wait_s: float = 5.0) -> BaseException:
        """The direct line to the executor closed: the daemon knows why the job ended. It
        learns of an executor's death a moment after the client may see it, so ask until the
        job shows as ended (at most `wait_s` seconds)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = self._request({"op": "info", "job": self._require_id()}).result()
            except SalusError as error:
                return error
            if info.get("state") in ("failed", "cancelled", "finished"):
                break
            if time.monotonic() > deadline:
                return DaemonUnavailable(f"lost the connection to job {self.id}'s executor: "
                                         f"{exc}")
            time.sleep(0.02)
        state, reason = info.get("state"), info.get("reason") or "its executor went away"
        if state == "failed":
            return JobFailed(reason)
        if state in ("cancelled", "finished"):
            return JobCancelled(reason)
        return DaemonUnavailable(f"lost the connection to job {self.id}'s executor: {exc}")

    def _rng_to_send(self) -> torch.Tensor | None:
        """The client's generator state when it changed since the job last had it."""
        state = torch.get_rng_state()
        if self._rng_synced is not None and torch.equal(state, self._rng_synced):
            return None
        self._rng_synced = state
        return state

    def _rng_back(self, state: torch.Tensor | None) -> None:
        if state is not None:
            state = state.clone()
            torch.set_rng_state(state)
            self._rng_synced = state


class Remote:
    """The job's state in the daemon: define functions over it, call them, pull it back."""

    def __init__(self, job: Job, objects: dict[str, Any]) -> None:
        self.job = job
        self.objects = dict(objects)
        self._next_fid = 0

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
        return job._request({"op": "call", "job": job._require_id(),
                             "fn": _pickled(fn, "function"),
                             "args": _pickled((args, kwargs), "call arguments"),
                             "rng": job._rng_to_send()}, self._decode_result).result()

    def fetch(self, *names: str) -> dict[str, Any]:
        """The daemon-side state of the named objects (all when none are named): a
        `state_dict()` for objects that have one, the tensor or object itself otherwise."""
        job = self.job
        result: dict[str, Any] = job._request(
            {"op": "pull", "job": job._require_id(), "names": list(names) or None},
            _pickled_result).result()
        return result

    def pull(self, *names: str) -> dict[str, Any]:
        """Copy the daemon-side state into the client's objects (`load_state_dict` for modules,
        optimizers, schedulers and scalers, `copy_` for tensors); returns what was fetched
        (plain objects cannot be updated in place: take them from the returned dict)."""
        fetched = self.fetch(*names)
        for name, value in fetched.items():
            obj = self.objects[name]
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(value)
        return fetched

    def _define(self, fn: Callable[..., Any], kind: str) -> RemoteFunction:
        if not callable(fn):
            raise TypeError(f"a {type(fn).__name__} is not a function")
        job = self.job
        fid = self._next_fid
        self._next_fid += 1
        job._request({"op": "define", "job": job._require_id(), "fid": fid, "kind": kind,
                      "fn": _pickled(fn, f"function {getattr(fn, '__name__', fn)!r}")}).result()
        return RemoteFunction(self, fid, fn)

    def _decode_result(self, reply: Any) -> Any:
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
        return _pickled_result(reply)


class RemoteFunction:
    """A function of the job, defined in the daemon: call it like the function itself."""

    def __init__(self, remote: Remote, fid: int, fn: Callable[..., Any]) -> None:
        self.remote = remote
        self.fid = fid
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "function")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        """Send the call and return at once; `.result()` waits for it."""
        remote = self.remote
        job = remote.job
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
            message = {"op": "call", "job": job._require_id(), "fid": self.fid,
                       "args": _pickled((args, kwargs), "call arguments"), "rng": rng}
        return job._request(message, remote._decode_result, direct=True)


class _ModeSync:
    """Follows the client's train/eval switches of a shipped model: before a call, if any
    submodule's `training` flag changed since the last call, the new flags are sent first."""

    def __init__(self, remote: Remote, model: nn.Module) -> None:
        self.remote = remote
        # The modules as shipped: the job's copy has exactly these, so walking the model's
        # tree again before every call (3.5 µs against 1.1 µs on a 6-module MLP, hot; more on
        # deeper models) would find nothing more.
        self.modules = list(model.modules())
        self.sent = _modes(self.modules)

    def sync(self) -> None:
        modes = _modes(self.modules)
        if modes != self.sent:
            self.remote.call(_set_modes, modes)
            self.sent = modes


def _modes(modules: list[nn.Module]) -> tuple[bool, ...]:
    return tuple(m.training for m in modules)


def _set_modes(s: Any, modes: tuple[bool, ...]) -> None:
    for module, mode in zip(s.model.modules(), modes, strict=True):
        module.training = mode


def _train_step(s: Any, *batch: Any) -> torch.Tensor:
    """One optimizer step; in a gang (`s.comm`) on this replica's part of the batch, with the
    gradients averaged over the gang, returning the gang's mean loss."""
    *inputs, target = batch
    s.optimizer.zero_grad()
    loss = s.loss_fn(s.model(*inputs), target)
    loss.backward()
    comm = getattr(s, "comm", None)
    if comm is not None:
        comm.all_reduce_gradients(s.model)
    s.optimizer.step()
    loss = loss.detach()
    if comm is not None:
        comm.all_reduce(loss, algorithm="ring")
        loss /= comm.size
    return loss


def _infer(s: Any, *inputs: Any, train_mode: bool) -> Any:
    s.model.train(train_mode)
    with torch.inference_mode():
        out = s.model(*inputs)
    comm = getattr(s, "comm", None)
    return out if comm is None else comm.gather_batch(out)


# ---- replies --------------------------------------------------------------------------------
class _Raise:
    """A reply that is an error raised on this side (connection lost, bad frame)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _json_result(reply: Any) -> Any:
    if isinstance(reply, _Raise):
        raise reply.error
    if type(reply) is compact.Message:
        raise FrameError(f"salusd answered with an unexpected compact frame {reply!r}")
    if isinstance(reply, dict) and reply.get("ok") is False and (
            reply.get("code") == CallFailed.code):
        raise _call_error(reply)
    return reply_result(reply)


def _pickled_result(reply: Any) -> Any:
    result = _json_result(reply)
    return result.load("result") if isinstance(result, PickledPayload) else result


def _call_error(reply: dict[str, Any]) -> BaseException:
    """The job's own exception, re-raised here with its remote traceback as a note (or a
    CallFailed carrying its type, message and traceback when it cannot be rebuilt)."""
    text = str(reply.get("traceback", ""))
    exc_type, message = str(reply.get("type", "")), str(reply.get("message", ""))
    payload = reply.get("exception")
    exc: BaseException | None = None
    if isinstance(payload, PickledPayload):
        try:
            exc = payload.load("exception")
        except Exception:
            exc = None
    if not isinstance(exc, BaseException) or isinstance(exc, SystemExit | KeyboardInterrupt):
        exc = CallFailed(f"the job's code raised {message}", exc_type, text)
    exc.add_note(f"--- raised in salusd, in the job's code ---\n{text.rstrip()}")
    return exc


# ---- pickling -------------------------------------------------------------------------------
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


def _pickled(obj: Any, what: str = "attached objects") -> Pickled:
    """`obj` to be pickled when its request is sent (by value where the executor could not
    import it)."""
    _register_by_value(obj)
    return Pickled(obj, what)


def _unpicklable(objects: dict[str, Any], exc: Exception) -> TypeError:
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

