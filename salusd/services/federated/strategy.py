"""Federated strategies: which clients a round samples, which of them run how many epochs with
which proximal coefficient, and how their updates become the next global model.

Conventions, as in the paper's experiments (Li et al., MLSys 2020, §5.1) and its reference code
(litian96/FedProx, ``flearn/trainers/fedbase.py``): each round samples K clients uniformly
without replacement and averages their updates with weights proportional to their training
sample counts n_k. (The paper's Algorithms 1 and 2 instead sample with probability n_k / n and
average uniformly; a subclass can override `select` and `aggregate` to follow those.)

Write another strategy by subclassing `Strategy`: give it a `name`, a `local_epochs` rule and,
if needed, another `mu`, `select` or `aggregate`. FedAvg that keeps partial work is
``FedProx(mu=0)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from .aggregate import weighted_average
from .task import ClientUpdate


class Strategy(ABC):
    """The policy of a federated job; pure: all randomness comes from the generator passed in."""

    mu: float = 0.0
    """Proximal coefficient of every local objective (0: none)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Label for results and plots."""

    @abstractmethod
    def local_epochs(self, epochs: int, budget: int) -> int:
        """Epochs a sampled client runs when the job asks for `epochs` and the client can finish
        `budget` epochs this round; 0 drops the client from the round."""

    def select(self, num_clients: int, k: int, rng: np.random.Generator) -> list[int]:
        """Ids of the clients sampled this round: `k` of `num_clients`, uniformly, no repeats."""
        chosen = rng.choice(num_clients, size=min(k, num_clients), replace=False)
        return sorted(int(c) for c in chosen)

    def aggregate(
        self, global_state: Mapping[str, Tensor], updates: Sequence[ClientUpdate]
    ) -> dict[str, Tensor]:
        """Next global ``state_dict``: the n_k-weighted average of the updates; the global model
        unchanged when no client reported."""
        if not updates:
            return dict(global_state)
        return weighted_average([u.state for u in updates], [u.num_samples for u in updates])


@dataclass(frozen=True)
class FedAvg(Strategy):
    """McMahan et al. (2017) under system heterogeneity, as in the FedProx paper: clients that
    cannot finish all epochs in the round's budget are dropped; no proximal term."""

    @property
    def name(self) -> str:
        return "FedAvg"

    def local_epochs(self, epochs: int, budget: int) -> int:
        return epochs if budget >= epochs else 0


@dataclass(frozen=True)
class FedProx(Strategy):
    """Li et al. (2020): every sampled client runs what its budget allows (at most `epochs`), and
    its partial work is aggregated with the same n_k weight as a full update; every local
    objective carries ``mu/2 * ||w - w_t||^2``."""

    mu: float = 1.0

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ValueError(f"mu must be non-negative, got {self.mu}")

    @property
    def name(self) -> str:
        return f"FedProx (mu={self.mu:g})"

    def local_epochs(self, epochs: int, budget: int) -> int:
        return min(epochs, budget)
