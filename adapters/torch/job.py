"""A job in salusd as the client holds it: `connect()` opens one, `Job.attach` ships its
objects, and `close()` ends it."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from salus.adapters.torch import sugar
from salus.adapters.torch.contract import check_registered
from salus.adapters.torch.pickling import pickled, unpicklable
from salus.adapters.torch.remote import Remote
from salus.adapters.torch.transport import Connection, connect_retrying
from salus.daemon.wire import compact
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.address import default_socket_path, parse_address
from salus.daemon.wire.channel import Channel
from salus.daemon.wire.client import hello
from salus.daemon.wire.errors import SalusError
from salus.daemon.wire.replicas import MAX_REPLICAS

INFO_WAIT_S = 2.0  # how long info() waits for the daemon to account calls run under a lease


def connect(name: str, iterations: int, *, address: str | None = None,
            timeout_s: float | None = 10.0, devices: int = 1) -> Job:
    """Open a job called `name` that plans `iterations` iterations in salusd; with `devices`
    N > 1, a data-parallel gang of N replicas (see the module docstring). The job ends when it
    is closed; `iterations` is what the scheduler plans with (SRTF ranks by it), and running
    past it warns once.

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
    sock = connect_retrying(path, timeout_s)
    job = Job(Channel(sock), name, iterations, path, devices)
    try:
        job._hello()
    except BaseException:
        job._channel.close()
        raise
    sock.settimeout(None)
    return job


class Job(Connection):
    """A connection to salusd carrying one job; use `connect()` to make one."""

    def __init__(self, channel: Channel, name: str, iterations: int, path: str,
                 devices: int = 1) -> None:
        super().__init__(channel, name, path)
        self.iterations = iterations
        self.devices = devices  # replicas: > 1 for a data-parallel gang
        self.resumed_from = 0  # > 0: salusd restored this job at that iteration (see connect)
        self.iterations_sent = 0  # calls of `@remote.iteration` functions sent
        self.owner: str | None = None
        self.threads: int | None = None
        self.remote: Remote | None = None
        self._compact = False

    def attach(self, **objects: Any) -> Remote:
        """Ship the named objects to the job in the daemon, with their current state; returns
        the `Remote` handle to define and call functions over them.

        From now on the job has its own copies. A module that keeps modules or parameters
        where `state_dict()` cannot see them (a plain list: use `nn.ModuleList`) is refused
        here, since `pull()` could not bring them back. An attached LR scheduler stepped on the
        client afterwards, or an optimizer given another learning rate, makes the next call or
        pull raise, naming it; a module changed here (run in train mode, which moves batch
        norm's statistics) the next pull. Make such changes in the job, e.g.
        `remote.call(lambda s: s.sched.step())`."""
        if self.remote is not None:
            raise RuntimeError(f"job {self.name!r} already has its state in salusd; open "
                               "another job with salus.connect() for other objects")
        if not objects:
            raise ValueError("attach needs at least one named object, e.g. attach(model=model)")
        check_registered(objects)
        payload = pickled(objects)
        try:
            future = self._request(ops.Attach(self._require_id(), payload,
                                              self._rng_to_send()))
        except TypeError as exc:
            self._rng_synced = None
            raise unpicklable(objects, exc) from exc
        future.result()
        self.remote = Remote(self, objects)
        if self.devices == 1:  # a gang's calls go to all replicas, through salusd
            self._open_direct()
        return self.remote

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[..., torch.Tensor]) -> sugar.TrainStep:
        """Ship `model`, `optimizer` and `loss_fn`; returns `step(*inputs, target) -> loss`
        which runs `loss_fn(model(*inputs), target)`, backward and `optimizer.step()` in the
        daemon. Train/eval switches of `model` on the client are followed.

        `step.submit(*inputs, target)` sends the step and returns at once with a `Loss`
        (`.result()` waits for the float), as CUDA runs a step's kernels while Python goes on:
        a loop that reads its losses later (or every N steps) keeps several steps in flight,
        at most `MAX_IN_FLIGHT` (32; a further submit first waits for the oldest). The job's
        executor then runs them back to back and the client wakes once for several results,
        which costs far less CPU per step where many jobs share few cores (docs/runtime.md,
        "Packing"). Steps run in the order submitted, with the same results either way."""
        return sugar.train_step(self, model, optimizer, loss_fn)

    def inference(self, model: nn.Module, *, train_mode: bool = False) -> Callable[..., Any]:
        """Ship `model`; returns `infer(*inputs) -> output` run in the daemon under
        `torch.inference_mode()` with the model in eval mode (train mode if `train_mode`).
        The output is the model's own pytree (a tensor, tuple, dict or `ModelOutput`)."""
        return sugar.inference(self, model, train_mode)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The job's model parameters and buffers now, as CPU tensors (the attached object
        called `model`); taking them counts as a pull for `close`'s warning."""
        if self.remote is None:
            raise RuntimeError(f"job {self.name!r} has no state in salusd yet")
        state: dict[str, torch.Tensor] = self.remote.fetch("model")["model"]
        self.remote.changed = False
        return state

    def info(self) -> dict[str, Any]:
        """The daemon's view of the job: state, progress, placement, memory, threads. It
        counts every call answered so far: the executor reports calls run under a lease a
        moment later (in batches, at most every 20 ms), so when the daemon's count lags, this
        asks the executor on the job's direct line to report at once and asks again (for at
        most INFO_WAIT_S)."""
        deadline = time.monotonic() + INFO_WAIT_S
        asked = False
        while True:
            result: dict[str, Any] = self._request(ops.Info(self._require_id())).result()
            if (int(result.get("calls_done") or 0) >= self._calls_answered
                    or result.get("state") in ("finished", "cancelled", "failed")
                    or time.monotonic() > deadline):
                return result
            if not asked:
                asked = True
                self._ask_report()
            else:
                time.sleep(0.001)

    def _ask_report(self) -> None:
        """Have the executor send the daemon its report of the calls it ran, now."""
        line = self._direct
        if line is None or line.broken is not None:
            return
        with contextlib.suppress(SalusError):  # the line broke: info() says why
            self._request({"op": "report"}, direct=True).result()

    def close(self, *, pull: bool | None = None) -> None:
        """Finish the job in the daemon and close the connection (idempotent). The job's state
        ends with it: `pull=True` pulls it into the attached objects first; `pull=False`
        discards it; by default (None) a `UserWarning` says so when calls may have changed it
        since the last `remote.pull()` (functions with `changes_state = False` do not count)."""
        self._finish(pull)

    def _finish(self, pull: bool | None) -> None:
        """`close`, called by `close` or `__exit__` (the warning names their caller's line)."""
        remote = self.remote
        try:
            if remote is not None and not self._closed and self._line.broken is None:
                if pull:
                    remote.pull()
                elif pull is None and remote.changed:
                    warnings.warn(
                        f"closing job {self.name!r} discards the state its calls changed since "
                        "the last pull(): the attached objects here do not have it. Call "
                        "remote.pull() before closing (or close(pull=True)), or "
                        "close(pull=False) to discard it", UserWarning, stacklevel=3)
        finally:
            super().close()

    def ping(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request(ops.Ping()).result()
        return result

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Leaving on an exception: that is what the user sees, not a warning about the state.
        self._finish(False if exc_type is not None else None)

    def __repr__(self) -> str:
        return f"Job(name={self.name!r}, id={self.id!r}, path={self.path!r})"

    def _hello(self) -> None:
        """Check the protocol version and open the job (its id, owner, threads)."""
        reply = hello(self._line, self._channel.max_frame_bytes)
        self._channel.peer_max_frame_bytes = int(reply["max_frame_bytes"])
        self.owner = reply.get("owner")
        self._compact = reply.get("compact") == compact.REVISION
        opened = self._request(ops.Open(self.name, self.iterations, os.getcwd(), self.devices,
                                        sys.executable)).result()
        self.id, self.threads = str(opened["job"]), opened.get("threads")
        self.resumed_from = int(opened.get("resumed_from") or 0)
