"""The seam between the server loop and where clients train: `ClientRunner`.

The server hands a runner one round's `ClientTask` s and gets one `ClientUpdate` per task back,
in any order. `InProcessRunner` trains the clients one after another in this process; a daemon
runner (each client's local epochs as a scheduled function of a job) implements the same
protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .client import train_client
from .data import ClientDataset
from .task import ClientTask, ClientUpdate


class ClientRunner(Protocol):
    """Runs one round of client tasks."""

    def run_round(self, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        """One update per task; a runner may train the tasks in any order or concurrently."""
        ...


class InProcessRunner:
    """Trains each task's client with `train_client`, sequentially, in the calling process."""

    def __init__(self, clients: Sequence[ClientDataset]) -> None:
        self._clients = list(clients)

    def run_round(self, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        return [train_client(task, self._clients[task.client_id]) for task in tasks]
