"""`salus.federated`: run a federated job from a script, its clients training in salusd.

    import salus.federated as fed

    clients = fed.synthetic(1.0, 1.0, devices=30, seed=0)
    result = fed.run(fed.synthetic_model, clients, fed.FedProx(mu=1.0), rounds=200,
                     clients_per_round=10, epochs=20, lr=0.01, batch_size=10,
                     straggler_share=0.9)
    print(result.train_losses[-1], result.test_accuracies[-1])

Each round's clients run as scheduled functions of jobs in the daemon (in parallel lanes,
sharing its devices); `runner=` takes any `ClientRunner` instead (e.g. `InProcessRunner`).
The algorithm lives in `salus.daemon.services.federated`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from salus.daemon.services.federated import (
    ClientDataset,
    ClientRunner,
    FedAvg,
    FederatedResult,
    FedProx,
    InProcessRunner,
    Strategy,
    synthetic,
    synthetic_model,
)
from salus.daemon.services.federated import run as run_rounds
from salus.federated.daemon_runner import DaemonRunner

__all__ = ["ClientDataset", "DaemonRunner", "FedAvg", "FedProx", "FederatedResult",
           "InProcessRunner", "Strategy", "run", "synthetic", "synthetic_model"]


def run(model_fn: Callable[[], nn.Module], clients: Sequence[ClientDataset], strategy: Strategy,
        rounds: int, *, runner: ClientRunner | None = None, address: str | None = None,
        lanes: int = 2, **settings: Any) -> FederatedResult:
    """Run `rounds` rounds of `strategy` over `clients`; `settings` are those of
    `salus.daemon.services.federated.run` (clients_per_round, epochs, lr, batch_size,
    straggler_share, seed, on_round). Without `runner`, the clients train in the daemon at
    `address` (default: `$SALUS_ADDRESS` or the default socket) on `lanes` jobs."""
    if runner is not None:
        return run_rounds(model_fn, clients, strategy, rounds, runner=runner, **settings)
    with DaemonRunner(clients, address, lanes=lanes, rounds=rounds) as daemon:
        return run_rounds(model_fn, clients, strategy, rounds, runner=daemon, **settings)
