"""Request dispatch of the data plane: check one decoded request and call the JobService.

Requests are dicts with an "op"; replies are `{"ok": true, "result": ...}` or
`{"ok": false, "code": ..., "message": ...}` with the codes of `salus.daemon.errors`.

    op               fields                                    result
    ping             max_frame_bytes (optional: the client's)  version, max_frame_bytes, owner
    open             name, iterations, kind                    {"job": id}
    setup_training   job, objects = Pickled((model, optimizer, loss_fn))  the daemon's figures
    setup_inference  job, model = Pickled(model)               the daemon's figures
    step             job, x, y (tensors)                       the loss (float)
    infer            job, x (tensor)                           the output tensor
    state_dict       job                                       {name: tensor}
    info             job                                       the job_info dict
    close            job                                       None

`step` and `infer` also come as compact messages (`compact.py`), which skip JSON: OP_STEP is
answered with OP_LOSS, OP_INFER with OP_OUTPUT (a JSON reply when the output is not a single
tensor), and errors with the JSON error reply. `ping`
announces `compact` (the compact revision this side speaks) so that clients know they may use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import torch

from salus.daemon.errors import BadRequest, JobCancelled, JobFailed, SalusError
from salus.daemon.ipc import compact
from salus.daemon.ipc.codec import PickledPayload
from salus.daemon.ipc.wire import VERSION
from salus.daemon.service import JobService

log = logging.getLogger("salus.daemon.ipc")
T = TypeVar("T")


def error_reply(code: str, message: str) -> dict[str, Any]:
    """The reply for a failed request."""
    return {"ok": False, "code": code, "message": message}


def _field(request: dict[str, Any], name: str, kind: type[T], what: str) -> T:
    value = request.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "nothing" if value is None else type(value).__name__
        raise BadRequest(f"'{request['op']}' needs field '{name}' ({what}), got {got}")
    return value


def _wait(future: Future[T], job_id: str) -> T:
    """The iteration's result; errors of the job's own code come back as JobFailed."""
    try:
        return future.result()
    except SalusError:
        raise
    except CancelledError:
        raise JobCancelled(f"job {job_id}'s iteration was cancelled") from None
    except Exception as exc:
        raise JobFailed(f"job {job_id}'s iteration raised {type(exc).__name__}: {exc}") from exc


class RequestHandler:
    """Serves one connection's requests for `owner`; remembers the jobs it opened so that they
    can be closed when the client goes away."""

    def __init__(self, service: JobService, owner: str, max_frame_bytes: int) -> None:
        self.service = service
        self.owner = owner
        self.max_frame_bytes = max_frame_bytes
        self.jobs: set[str] = set()
        self.peer_max_frame_bytes: int | None = None
        self._ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "ping": self._ping, "open": self._open, "setup_training": self._setup_training,
            "setup_inference": self._setup_inference, "step": self._step, "infer": self._infer,
            "state_dict": self._state_dict, "info": self._info, "close": self._close,
            "status": self._status, "suspend": self._suspend, "resume": self._resume,
            "cancel": self._cancel, "priority": self._priority,
        }

    def handle(self, request: Any) -> dict[str, Any] | compact.Message:
        """The reply to one request; never raises."""
        try:
            if type(request) is compact.Message:
                return self._compact(request)
            if not isinstance(request, dict):
                raise BadRequest("a request must be a JSON object with an 'op' field")
            op = request.get("op")
            fn = self._ops.get(op) if isinstance(op, str) else None
            if fn is None:
                raise BadRequest(f"unknown op {op!r}; expected one of {sorted(self._ops)}")
            return {"ok": True, "result": fn(request)}
        except SalusError as exc:
            return error_reply(exc.code, str(exc))
        except Exception as exc:
            log.exception("request from %s failed inside salusd", self.owner)
            return error_reply(SalusError.code, f"internal error in salusd ({type(exc).__name__}:"
                                                f" {exc}); the daemon log has the traceback")

    def _compact(self, request: compact.Message) -> dict[str, Any] | compact.Message:
        """A compact step or inference call (the decoder checked its tensor count); an output
        that is not one tensor goes back in a JSON reply."""
        job_id, tensors = request.job, request.tensors
        if request.op == compact.OP_STEP:
            loss = _wait(self.service.step(job_id, self.owner, tensors[0], tensors[1]), job_id)
            return compact.Message(compact.OP_LOSS, value=float(loss))
        if request.op == compact.OP_INFER:
            out = _wait(self.service.infer(job_id, self.owner, tensors[0]), job_id)
            if isinstance(out, torch.Tensor):
                return compact.Message(compact.OP_OUTPUT, tensors=(out,))
            return {"ok": True, "result": out}
        raise BadRequest(f"compact op {compact.OP_NAMES[request.op]!r} is a reply, not a request")

    def close_all(self) -> list[str]:
        """Close every job this connection opened and did not close; returns their ids."""
        closed = sorted(self.jobs)
        for job_id in closed:
            try:
                self.service.close_job(job_id, self.owner)
            except Exception:
                log.exception("closing job %s of %s failed", job_id, self.owner)
        self.jobs.clear()
        return closed

    def _job(self, request: dict[str, Any]) -> str:
        return _field(request, "job", str, "a job id from 'open'")

    def _ping(self, request: dict[str, Any]) -> dict[str, Any]:
        peer_max = request.get("max_frame_bytes")
        if isinstance(peer_max, int) and not isinstance(peer_max, bool) and peer_max >= 1024:
            self.peer_max_frame_bytes = peer_max
        return {"version": VERSION, "max_frame_bytes": self.max_frame_bytes, "owner": self.owner,
                "compact": compact.REVISION}

    def _open(self, request: dict[str, Any]) -> dict[str, str]:
        name = _field(request, "name", str, "the job's name")
        iterations = _field(request, "iterations", int, "the planned number of iterations")
        kind = _field(request, "kind", str, "'training' or 'inference'")
        if kind not in ("training", "inference"):
            raise BadRequest(f"job kind must be 'training' or 'inference', got {kind!r}")
        job_id = self.service.open_job(self.owner, name, iterations, kind)
        self.jobs.add(job_id)
        return {"job": job_id}

    def _setup_training(self, request: dict[str, Any]) -> dict[str, Any]:
        job_id = self._job(request)
        payload = _field(request, "objects", PickledPayload, "the pickled model, optimizer and "
                                                              "loss function")
        objects = payload.load("model, optimizer and loss function")
        if not (isinstance(objects, tuple) and len(objects) == 3):
            raise BadRequest("'objects' must unpickle to a (model, optimizer, loss_fn) tuple")
        model, optimizer, loss_fn = objects
        return self.service.setup_training(job_id, self.owner, model, optimizer, loss_fn)

    def _setup_inference(self, request: dict[str, Any]) -> dict[str, Any]:
        job_id = self._job(request)
        payload = _field(request, "model", PickledPayload, "the pickled model")
        return self.service.setup_inference(job_id, self.owner, payload.load("model"))

    def _step(self, request: dict[str, Any]) -> float:
        job_id = self._job(request)
        x = _field(request, "x", torch.Tensor, "the input batch")
        y = _field(request, "y", torch.Tensor, "the target batch")
        return float(_wait(self.service.step(job_id, self.owner, x, y), job_id))

    def _infer(self, request: dict[str, Any]) -> torch.Tensor:
        job_id = self._job(request)
        x = _field(request, "x", torch.Tensor, "the input batch")
        return _wait(self.service.infer(job_id, self.owner, x), job_id)

    def _state_dict(self, request: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.service.state_dict(self._job(request), self.owner)

    def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.service.job_info(self._job(request), self.owner)

    def _close(self, request: dict[str, Any]) -> None:
        job_id = self._job(request)
        self.service.close_job(job_id, self.owner)
        self.jobs.discard(job_id)

    def _status(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.service.snapshot()

    def _suspend(self, request: dict[str, Any]) -> None:
        swap = request.get("swap", False)
        if not isinstance(swap, bool):
            raise BadRequest("'suspend' field 'swap' must be true or false")
        self.service.suspend(self._job(request), self.owner, swap=swap)

    def _resume(self, request: dict[str, Any]) -> None:
        self.service.resume(self._job(request), self.owner)

    def _cancel(self, request: dict[str, Any]) -> None:
        self.service.cancel(self._job(request), self.owner)

    def _priority(self, request: dict[str, Any]) -> None:
        priority = request.get("priority")
        if isinstance(priority, bool) or not isinstance(priority, int | float) or priority <= 0:
            raise BadRequest(f"'priority' needs a number > 0, got {priority!r}")
        self.service.set_priority(self._job(request), self.owner, float(priority))
