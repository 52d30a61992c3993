"""The interface the data plane (and REST) call on the daemon core.

Methods that wait for the scheduler return a `concurrent.futures.Future`; they raise (or set on the
future) a `salus.daemon.errors.SalusError` subclass on bad input. `owner` is the caller's user
name as the transport authenticated it (unix peer credentials, or the REST token's owner).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, Protocol

import torch

JobKind = Literal["training", "inference"]


class JobService(Protocol):
    def open_job(self, owner: str, name: str, iterations: int, kind: JobKind) -> str:
        """Register a job; returns its id. `iterations` is the number the client plans to run."""
        ...

    def setup_training(
        self,
        job_id: str,
        owner: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
    ) -> dict[str, Any]:
        """Take ownership of the model, optimizer and loss; returns what the daemon measured
        (persistent bytes). Admission happens at the first step, when a batch shape is known."""
        ...

    def setup_inference(self, job_id: str, owner: str, model: torch.nn.Module) -> dict[str, Any]:
        """Take ownership of an inference model; admission at the first call."""
        ...

    def step(
        self, job_id: str, owner: str, inputs: torch.Tensor, target: torch.Tensor
    ) -> Future[float]:
        """Queue one training iteration; resolves to the loss as a float once it has run."""
        ...

    def infer(self, job_id: str, owner: str, inputs: torch.Tensor) -> Future[torch.Tensor]:
        """Queue one inference call; resolves to the output on the host (CPU)."""
        ...

    def state_dict(self, job_id: str, owner: str) -> dict[str, torch.Tensor]:
        """The job's current parameters and buffers as CPU tensors (copies)."""
        ...

    def job_info(self, job_id: str, owner: str) -> dict[str, Any]:
        """Placement, progress and memory figures of one job (JSON-able)."""
        ...

    def close_job(self, job_id: str, owner: str) -> None:
        """Finish the job and free its memory; idempotent for a job already closed by this owner."""
        ...

    def suspend(self, job_id: str, owner: str, *, swap: bool = False) -> None:
        """Stop scheduling the job from its next iteration boundary (`swap`: move its state to
        host memory and give its device memory to waiting jobs)."""
        ...

    def resume(self, job_id: str, owner: str) -> None:
        """Schedule a suspended job again."""
        ...

    def cancel(self, job_id: str, owner: str) -> None:
        """End the job at its next boundary; its client's queued and later calls fail."""
        ...

    def set_priority(self, job_id: str, owner: str, priority: float) -> None:
        """Change the job's weight under the fair policy (> 0)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Devices, arenas, lanes and jobs as JSON-able data."""
        ...
