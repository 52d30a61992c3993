"""Federated jobs: FedAvg and FedProx over simulated clients, synthetic(alpha, beta) data.

`run` is the server loop; `Strategy` (with `FedAvg`, `FedProx`) is the policy; a `ClientRunner`
trains each round's `ClientTask` s with `train_client`: `InProcessRunner` one after another in
this process, `DaemonRunner` (in `salus.federated.daemon_runner`, beside the client adapter it
uses) as scheduled functions of jobs in salusd. Progress bars and plots live in the `progress`
and `plot` submodules.
"""

from .aggregate import weighted_average
from .client import train_client
from .data import ClientDataset
from .job import FederatedResult, RoundRecord, run
from .runner import ClientRunner, InProcessRunner
from .stragglers import epoch_budgets
from .strategy import FedAvg, FedProx, Strategy
from .synthetic import synthetic, synthetic_model
from .task import ClientTask, ClientUpdate

__all__ = [
    "ClientDataset",
    "ClientRunner",
    "ClientTask",
    "ClientUpdate",
    "FedAvg",
    "FedProx",
    "FederatedResult",
    "InProcessRunner",
    "RoundRecord",
    "Strategy",
    "epoch_budgets",
    "run",
    "synthetic",
    "synthetic_model",
    "train_client",
    "weighted_average",
]
