"""A federated job: the server loop of FedAvg / FedProx over simulated clients.

Only the global model persists between rounds; a client starts every round from the global
weights it is sent and keeps nothing afterwards. Each round, with randomness derived from the
job's seed and the round number only (so strategies compared side by side see the same clients,
the same stragglers and the same minibatch orders):

1. the strategy samples K client ids;
2. `epoch_budgets` gives each a work budget (epochs it can finish this round);
3. the strategy turns budgets into local epochs (0 drops a client) and the server builds one
   `ClientTask` per remaining client;
4. a `ClientRunner` trains them and returns their updates;
5. the strategy aggregates the updates into the next global model, which is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .data import ClientDataset
from .evaluate import evaluate
from .runner import ClientRunner, InProcessRunner
from .stragglers import epoch_budgets
from .strategy import Strategy
from .task import ClientTask

_SELECT, _STRAGGLERS, _CLIENT = 0, 1, 2  # independent random streams per round


@dataclass(frozen=True)
class RoundRecord:
    """The global model after round `round` (0: the initial model, before any training).

    `train_loss` in nats per training sample, `test_accuracy` a fraction; `budgets` maps each
    sampled client to the epochs it could finish, `epochs` each aggregated client to the epochs
    it ran (sampled clients missing from it were dropped). Both are empty for round 0.
    """

    round: int
    train_loss: float
    test_accuracy: float
    budgets: dict[int, int]
    epochs: dict[int, int]


@dataclass(frozen=True)
class FederatedResult:
    """Per-round records of one job and its final global ``state_dict``."""

    strategy: str
    records: list[RoundRecord]
    final_state: dict[str, Tensor]

    @property
    def train_losses(self) -> list[float]:
        """Global training loss (nats per sample) after rounds 0..R."""
        return [r.train_loss for r in self.records]

    @property
    def test_accuracies(self) -> list[float]:
        """Global test accuracy (fraction) after rounds 0..R."""
        return [r.test_accuracy for r in self.records]

    def to_json(self) -> dict[str, Any]:
        """The records as a JSON-ready object (client ids become string keys)."""
        return {"strategy": self.strategy, "rounds": [asdict(r) for r in self.records]}


def run(
    model_fn: Callable[[], nn.Module],
    clients: Sequence[ClientDataset],
    strategy: Strategy,
    rounds: int,
    *,
    clients_per_round: int = 10,
    epochs: int = 20,
    lr: float = 0.01,
    batch_size: int = 10,
    straggler_share: float = 0.0,
    seed: int = 0,
    runner: ClientRunner | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> FederatedResult:
    """Train `model_fn()`'s model over `clients` for `rounds` rounds of `strategy`.

    `clients_per_round` is K, `epochs` the local epochs E of a client that is not a straggler,
    `lr` the SGD step size, `batch_size` samples per minibatch, `straggler_share` the fraction
    of each round's clients that are stragglers (system heterogeneity), `seed` fixes the initial
    model and every random choice. `runner` trains the clients (default: `InProcessRunner`);
    `on_round` sees each `RoundRecord` as it is made, round 0 included. The caller's torch random
    state is left as it was.
    """
    if not clients:
        raise ValueError("a federated job needs at least one client")
    if rounds < 0 or clients_per_round < 1 or epochs < 1:
        raise ValueError("rounds must be >= 0, clients_per_round and epochs >= 1")
    runner = runner if runner is not None else InProcessRunner(clients)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_fn()
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    records = [_record(model, state, clients, 0, {}, {})]
    if on_round is not None:
        on_round(records[0])
    for round_index in range(1, rounds + 1):
        select_rng = _rng(seed, round_index, _SELECT)
        selected = strategy.select(len(clients), clients_per_round, select_rng)
        straggler_rng = _rng(seed, round_index, _STRAGGLERS)
        budgets = epoch_budgets(selected, epochs, straggler_share, straggler_rng)
        tasks = [
            ClientTask(
                client_id=client,
                global_state=state,
                model_fn=model_fn,
                epochs=local,
                mu=strategy.mu,
                lr=lr,
                batch_size=batch_size,
                seed=_client_seed(seed, round_index, client),
            )
            for client in selected
            if (local := strategy.local_epochs(epochs, budgets[client])) > 0
        ]
        updates = runner.run_round(tasks)
        state = strategy.aggregate(state, updates)
        ran = {u.client_id: u.epochs for u in updates}
        records.append(_record(model, state, clients, round_index, budgets, ran))
        if on_round is not None:
            on_round(records[-1])
    return FederatedResult(strategy.name, records, state)


def _record(
    model: nn.Module,
    state: dict[str, Tensor],
    clients: Sequence[ClientDataset],
    round_index: int,
    budgets: dict[int, int],
    epochs: dict[int, int],
) -> RoundRecord:
    model.load_state_dict(state)
    loss, accuracy = evaluate(model, clients)
    return RoundRecord(round_index, loss, accuracy, budgets, epochs)


def _rng(seed: int, round_index: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, round_index, stream])


def _client_seed(seed: int, round_index: int, client: int) -> int:
    sequence = np.random.SeedSequence([seed, round_index, _CLIENT, client])
    return int(sequence.generate_state(1)[0])
