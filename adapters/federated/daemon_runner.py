"""`DaemonRunner`: each round's clients train as scheduled functions of jobs in salusd.

The runner opens `lanes` jobs in the daemon. Each holds every client's dataset (its persistent
state; no client model is kept between rounds) and defines one function, `train_client` over
that data. A round's tasks are spread over the jobs and submitted at once, so the daemon runs
them in parallel lanes on shared devices, in its own executors, as their owner; each task
carries the global model, and each update comes back as a `ClientUpdate`. The clients train
exactly as `InProcessRunner` trains them (`train_client`, seeded by the task), so the two
runners give the same global model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import salus.adapters.torch as salus
from salus.daemon.services.federated import ClientDataset, ClientTask, ClientUpdate, train_client


def _train(s: Any, task: ClientTask) -> ClientUpdate:
    return train_client(task, s.clients[task.client_id])


class DaemonRunner:
    """Runs rounds through the daemon at `address` (`unix:///path`, or None for the default)
    on `lanes` jobs; a context manager that closes them."""

    def __init__(self, clients: Sequence[ClientDataset], address: str | None = None, *,
                 lanes: int = 2, name: str = "federated", rounds: int = 1000) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._jobs: list[salus.Job] = []
        self._functions: list[salus.RemoteFunction] = []
        try:
            for i in range(lanes):
                job = salus.connect(name=f"{name}-{i}", iterations=rounds, address=address)
                self._jobs.append(job)
                remote = job.attach(clients=list(clients))
                self._functions.append(remote.function(_train))
        except BaseException:
            self.close()
            raise

    def run_round(self, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        futures = [self._functions[i % len(self._functions)].submit(task)
                   for i, task in enumerate(tasks)]
        return [f.result() for f in futures]

    def close(self) -> None:
        for job in self._jobs:
            job.close()
        self._jobs.clear()

    def __enter__(self) -> DaemonRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
