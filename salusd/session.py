"""A job inside the daemon: the model, optimizer and loss it shipped, and how one iteration runs.

The session owns no thread; a lane worker calls `run` for one queued request at a time. Training
uses `optimizer.zero_grad(set_to_none=False)` so that backward accumulates into the gradient
buffers placed in the arena; parameters that got no gradient this iteration see `grad = None`
during `optimizer.step()`, exactly as in a loop that uses the default `zero_grad()`, so training
through the daemon gives the same parameters as training directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

from salus.daemon.memory.arena import Arena
from salus.daemon.memory.residency import ResidentState

JobKind = Literal["training", "inference"]


@dataclass
class Request:
    """One queued iteration: `op` with its tensors and the future the client waits on."""

    op: Literal["step", "infer"]
    tensors: tuple[torch.Tensor, ...]
    future: Future[Any]


@dataclass
class IterationResult:
    value: Any
    seconds: float
    peak_bytes: int | None


class Session:
    """One job's objects and queue; guarded by the daemon's lock except inside `run`."""

    def __init__(
        self, job_id: int, owner: str, name: str, kind: JobKind, planned_iterations: int
    ) -> None:
        self.job_id = job_id
        self.owner = owner
        self.name = name
        self.kind: JobKind = kind
        self.planned_iterations = planned_iterations
        self.priority = 1.0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn: Callable[..., torch.Tensor] | None = None
        self.requests: deque[Request] = deque()
        self.resident: ResidentState | None = None
        self.resident_device: int | None = None
        self.submitted = False
        self.held = False
        self.swap_requested = False
        self.measured_peak: int | None = None
        self.estimated_peak: int | None = None
        self.persistent_bytes = 0
        self.persistent_reserve = 0
        self.last_loss: float | None = None
        self.closed = False
        self._optimizer_adopted = False

    @property
    def ready(self) -> bool:
        return bool(self.requests) and not self.closed

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[..., torch.Tensor] | None,
    ) -> None:
        """Take the job's objects."""
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn

    # ---- memory --------------------------------------------------------------------------
    def make_resident(self, arena: Arena, device: int) -> None:
        """Place (or move back) the persistent state into `arena` of daemon device `device`."""
        assert self.model is not None
        if self.resident is not None and self.resident_device == device:
            if self.resident.swapped:
                self.resident.swap_in()
            return
        self.evict()
        self.model.to(arena.device)
        self.resident = ResidentState.place(arena, self.model, self.optimizer)
        self.resident_device = device
        self._optimizer_adopted = bool(self.optimizer and self.optimizer.state)

    def evict(self) -> None:
        """Give the arena memory back; the tensors live on in host memory."""
        if self.resident is not None:
            self.resident.release()
        self.resident = None
        self.resident_device = None

    # ---- running -------------------------------------------------------------------------
    def run(self, request: Request, measure: Callable[[Callable[[], Any]], tuple[Any, int]] | None,
            device: torch.device) -> IterationResult:
        """Run one iteration (the caller holds no lock). `measure` wraps it in a storage tracker."""
        tensors = tuple(t.to(device, non_blocking=True) for t in request.tensors)

        def once() -> Any:
            if request.op == "step":
                return self._train(*tensors)
            return self._infer(*tensors)

        start = time.perf_counter()
        if measure is None:
            value, peak = once(), None
        else:
            value, peak = measure(once)
        seconds = time.perf_counter() - start
        if request.op == "step" and not self._optimizer_adopted and self.resident is not None:
            self.resident.adopt_optimizer_state()
            self._optimizer_adopted = True
        return IterationResult(value, seconds, peak)

    def _train(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        model, optimizer, loss_fn = self.model, self.optimizer, self.loss_fn
        assert model is not None and optimizer is not None and loss_fn is not None
        optimizer.zero_grad(set_to_none=False)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # Backward adds into a gradient in place (bumping its version) or replaces it.
        before = [(p.grad, p.grad._version if p.grad is not None else -1) for p in params]
        loss = loss_fn(model(inputs), target)
        loss.backward()
        idle = [p for p, (grad, version) in zip(params, before, strict=True)
                if grad is not None and p.grad is grad and grad._version == version]
        saved = [p.grad for p in idle]
        for p in idle:
            p.grad = None
        optimizer.step()
        for p, g in zip(idle, saved, strict=True):
            p.grad = g
        value = float(loss.detach())
        self.last_loss = value
        return value

    def _infer(self, inputs: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        with torch.inference_mode():
            out = self.model(inputs)
        return out.detach().to("cpu")
