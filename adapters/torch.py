"""PyTorch adapter: run a script's training and inference iterations inside salusd.

    import salus.adapters.torch as salus

    with salus.connect(name="mlp", iterations=500) as job:
        step = job.train_step(model, optimizer, loss_fn)  # ships the three objects to salusd
        for x, y in batches:
            loss = step(x, y)       # one iteration in the daemon; a float
        state = job.state_dict()    # the trained parameters, CPU tensors

    infer = salus.connect(name="serve", iterations=1000).inference(model)
    out = infer(x)                  # a tensor on the client

The daemon is found at `address=` (`unix:///path`), else `$SALUS_ADDRESS`, else the default
socket (`salus.daemon.ipc.wire.default_socket_path`). One `Job` is one connection and one daemon
job, whose kind (training or inference) is fixed by the first `train_step()` or `inference()`;
closing the job, or the client exiting, frees it in the daemon. Every call holds the job's lock
for its request and reply, so a job may be shared between threads.

Needs torch, cloudpickle and the standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from salus.daemon.errors import DaemonUnavailable, SalusError
from salus.daemon.ipc import compact
from salus.daemon.ipc.wire import (
    VERSION,
    Channel,
    ConnectionClosed,
    FrameError,
    Pickled,
    connect_unix,
    default_socket_path,
    parse_address,
    reply_result,
)

__all__ = ["DaemonUnavailable", "Inference", "Job", "TrainStep", "connect"]


def connect(name: str, iterations: int, *, address: str | None = None,
            timeout_s: float | None = 10.0) -> Job:
    """Connect to salusd for a job called `name` that plans `iterations` iterations.

    `timeout_s` (seconds) bounds connecting and the first exchange; iterations themselves wait
    as long as the daemon's scheduler makes them.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    path = parse_address(address) if address is not None else default_socket_path()
    sock = connect_unix(path, timeout_s)
    job = Job(Channel(sock), name, iterations, path)
    try:
        job._hello()
    except BaseException:
        job._channel.close()
        raise
    sock.settimeout(None)
    return job


class Job:
    """A connection to salusd carrying one job; use `connect()` to make one."""

    def __init__(self, channel: Channel, name: str, iterations: int, path: str) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self.name = name
        self.iterations = iterations
        self.path = path
        self.id: str | None = None
        self.kind: str | None = None
        self.owner: str | None = None
        self._closed = False
        self._broken = False
        self._compact = False  # whether the daemon takes compact step/infer frames (from ping)

    def train_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[..., torch.Tensor]) -> TrainStep:
        """Ship `model`, `optimizer` and `loss_fn` to the daemon; returns `step(x, y) -> loss`
        which runs `loss_fn(model(x), y)`, backward and `optimizer.step()` there."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(output, target)")
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer must be built over model.parameters()")
        job_id = self._open("training")
        self._call("setup_training", job=job_id,
                   objects=Pickled((model, optimizer, loss_fn), "model, optimizer and loss"))
        return TrainStep(self, job_id)

    def inference(self, model: torch.nn.Module) -> Inference:
        """Ship `model` to the daemon; returns `infer(x) -> output` run there without grad."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        job_id = self._open("inference")
        self._call("setup_inference", job=job_id, model=Pickled(model, "model"))
        return Inference(self, job_id)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The job's current parameters and buffers, as CPU tensors."""
        result: dict[str, torch.Tensor] = self._call("state_dict", job=self._require_id())
        return result

    def info(self) -> dict[str, Any]:
        """The daemon's view of the job: placement, progress, memory figures."""
        result: dict[str, Any] = self._call("info", job=self._require_id())
        return result

    def ping(self) -> dict[str, Any]:
        """One round trip to the daemon; returns its protocol version, frame limit (bytes) and
        the user name it knows this client as."""
        result: dict[str, Any] = self._call("ping")
        return result

    def close(self) -> None:
        """Finish the job in the daemon and close the connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.id is not None and not self._broken:
                    self._exchange({"op": "close", "job": self.id})
            except (DaemonUnavailable, SalusError):
                pass
            finally:
                self._channel.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Job(name={self.name!r}, id={self.id!r}, kind={self.kind!r}, path={self.path!r})"

    def _hello(self) -> None:
        reply = self._call("ping", max_frame_bytes=self._channel.max_frame_bytes)
        if not isinstance(reply, dict) or reply.get("version") != VERSION:
            raise DaemonUnavailable(f"salusd at {self.path} speaks another protocol version "
                                    f"({reply!r}); install matching versions")
        self._channel.peer_max_frame_bytes = int(reply["max_frame_bytes"])
        self.owner = reply.get("owner")
        self._compact = reply.get("compact") == compact.REVISION

    def _open(self, kind: str) -> str:
        if self.id is not None:
            raise RuntimeError(f"job {self.name!r} already runs {self.kind} in salusd; open "
                               "another with salus.connect() for a second model")
        result = self._call("open", name=self.name, iterations=self.iterations, kind=kind)
        self.id, self.kind = str(result["job"]), kind
        return self.id

    def _require_id(self) -> str:
        if self.id is None:
            raise RuntimeError(f"job {self.name!r} has no model in salusd yet: call "
                               "train_step() or inference() first")
        return self.id

    def _call(self, op: str, **fields: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"job {self.name!r} is closed")
            return reply_result(self._exchange({"op": op, **fields}))

    def _call_compact(self, request: compact.Message, answer: int) -> Any:
        """Send a compact request; the reply's message when it is op `answer`, else the result
        of a JSON reply (errors raise)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"job {self.name!r} is closed")
            reply = self._exchange(request)
        if type(reply) is compact.Message:
            if reply.op != answer:
                raise FrameError(f"salusd answered a compact {compact.OP_NAMES[request.op]} "
                                 f"with {reply!r}")
            return reply
        return reply_result(reply)

    def _exchange(self, request: dict[str, Any] | compact.Message) -> Any:
        """One request and its raw reply; the caller holds the lock."""
        if self._broken:
            raise DaemonUnavailable(f"the connection to salusd at {self.path} was lost")
        try:
            self._channel.send(request)
            return self._channel.recv()
        except (ConnectionClosed, OSError) as exc:
            self._broken = True
            raise DaemonUnavailable(f"lost the connection to salusd at {self.path}: "
                                    f"{exc}") from None
        except (FrameError, TypeError) as exc:
            # Encoding errors and skipped frames leave the stream in step; anything else not.
            self._broken = self._broken or not getattr(exc, "recoverable", True)
            raise
        except BaseException:
            # Interrupted between request and reply: a late reply would answer the next call.
            self._broken = True
            raise


class TrainStep:
    """`step(x, y) -> loss`: one training iteration of a job inside salusd."""

    def __init__(self, job: Job, job_id: str) -> None:
        self.job = job
        self.job_id = job_id

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"step(x, y) takes two tensors, got {type(x).__name__} and "
                            f"{type(y).__name__}")
        job = self.job
        if job._compact:
            request = compact.Message(compact.OP_STEP, self.job_id, (x, y))
            reply = job._call_compact(request, compact.OP_LOSS)
            if type(reply) is not compact.Message:
                raise FrameError(f"salusd answered a step with {reply!r}")
            return reply.value
        return float(job._call("step", job=self.job_id, x=x, y=y))


class Inference:
    """`infer(x) -> output`: one inference call of a job inside salusd."""

    def __init__(self, job: Job, job_id: str) -> None:
        self.job = job
        self.job_id = job_id

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"infer(x) takes a tensor, got {type(x).__name__}")
        job = self.job
        if job._compact:
            reply = job._call_compact(compact.Message(compact.OP_INFER, self.job_id, (x,)),
                                      compact.OP_OUTPUT)
            out: torch.Tensor = reply.tensors[0] if type(reply) is compact.Message else reply
            return out
        out = job._call("infer", job=self.job_id, x=x)
        return out
