"""The server loop: what FedAvg and FedProx send and aggregate, equivalences, determinism,
and the progress bar and plot at the edges."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from salus.daemon.services.federated import (
    ClientDataset,
    ClientTask,
    ClientUpdate,
    FedAvg,
    FederatedResult,
    FedProx,
    InProcessRunner,
    Strategy,
    run,
    synthetic,
    synthetic_model,
)
from salus.daemon.services.federated.progress import round_progress

torch.set_num_threads(1)

E = 4
SETTING = {"clients_per_round": 6, "epochs": E, "lr": 0.01, "batch_size": 10}


@pytest.fixture(scope="module")
def clients() -> list[ClientDataset]:
    # 12 small devices keep a round well under a second on two cores
    return [c for c in synthetic(1.0, 1.0, devices=40, seed=5) if c.num_train < 200][:12]


class RecordingRunner:
    """An `InProcessRunner` that keeps each round's tasks and updates."""

    def __init__(self, clients: Sequence[ClientDataset]) -> None:
        self.inner = InProcessRunner(clients)
        self.rounds: list[tuple[list[ClientTask], list[ClientUpdate]]] = []

    def run_round(self, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        updates = self.inner.run_round(tasks)
        self.rounds.append((list(tasks), updates))
        return updates


def _one_round(
    clients: list[ClientDataset], strategy: Strategy, share: float
) -> tuple[FederatedResult, RecordingRunner]:
    runner = RecordingRunner(clients)
    result = run(synthetic_model, clients, strategy, 1, straggler_share=share, seed=2,
                 runner=runner, **SETTING)
    return result, runner


def _hand_average(updates: Sequence[ClientUpdate], key: str) -> torch.Tensor:
    total = sum(u.num_samples for u in updates)
    acc = torch.zeros_like(updates[0].state[key], dtype=torch.float64)
    for u in updates:
        acc += u.num_samples / total * u.state[key].double()
    return acc.float()


def test_fedavg_drops_stragglers_and_averages_the_rest_by_samples(
    clients: list[ClientDataset],
) -> None:
    result, runner = _one_round(clients, FedAvg(), 0.5)
    budgets = result.records[1].budgets
    assert len(budgets) == 6 and sum(b < E for b in budgets.values()) == 3
    [(tasks, updates)] = runner.rounds
    assert {t.client_id for t in tasks} == {c for c, b in budgets.items() if b == E}
    assert all(t.epochs == E and t.mu == 0.0 for t in tasks)
    assert result.records[1].epochs == {c: E for c, b in budgets.items() if b == E}
    for key in ("weight", "bias"):
        assert torch.allclose(result.final_state[key], _hand_average(updates, key), atol=1e-7)


def test_fedprox_keeps_stragglers_partial_work_weighted_by_samples(
    clients: list[ClientDataset],
) -> None:
    result, runner = _one_round(clients, FedProx(0.5), 0.5)
    fedavg, _ = _one_round(clients, FedAvg(), 0.5)
    budgets = result.records[1].budgets
    assert budgets == fedavg.records[1].budgets  # same clients and stragglers for both
    [(tasks, updates)] = runner.rounds
    assert {t.client_id: t.epochs for t in tasks} == budgets  # budgets are all <= E here
    assert sum(t.epochs < E for t in tasks) == 3 and all(t.mu == 0.5 for t in tasks)
    assert {u.client_id: u.num_samples for u in updates} == {
        t.client_id: clients[t.client_id].num_train for t in tasks
    }
    for key in ("weight", "bias"):
        assert torch.allclose(result.final_state[key], _hand_average(updates, key), atol=1e-7)


def test_at_90_percent_stragglers_fedavg_trains_one_client_of_ten(
    clients: list[ClientDataset],
) -> None:
    runner = RecordingRunner(clients)
    run(synthetic_model, clients, FedAvg(), 1, straggler_share=0.9, seed=0, runner=runner,
        **{**SETTING, "clients_per_round": 10})
    assert len(runner.rounds[0][0]) == 1


def test_fedprox_with_mu_0_and_no_stragglers_equals_fedavg(clients: list[ClientDataset]) -> None:
    fedavg = run(synthetic_model, clients, FedAvg(), 3, seed=1, **SETTING)
    fedprox = run(synthetic_model, clients, FedProx(0.0), 3, seed=1, **SETTING)
    assert fedavg.train_losses == fedprox.train_losses
    assert all(torch.equal(fedavg.final_state[k], fedprox.final_state[k])
               for k in fedavg.final_state)


def test_a_three_round_run_is_deterministic_for_a_seed(clients: list[ClientDataset]) -> None:
    before = torch.get_rng_state()
    seen: list[int] = []
    a = run(synthetic_model, clients, FedProx(1.0), 3, straggler_share=0.5, seed=7,
            on_round=lambda r: seen.append(r.round), **SETTING)
    b = run(synthetic_model, clients, FedProx(1.0), 3, straggler_share=0.5, seed=7, **SETTING)
    c = run(synthetic_model, clients, FedProx(1.0), 3, straggler_share=0.5, seed=8, **SETTING)
    assert torch.equal(torch.get_rng_state(), before)
    assert seen == [0, 1, 2, 3]
    assert a.records == b.records
    assert all(torch.equal(a.final_state[k], b.final_state[k]) for k in a.final_state)
    assert a.train_losses != c.train_losses
    assert a.train_losses[-1] < a.train_losses[0]
    rounds = json.loads(json.dumps(a.to_json()))["rounds"]
    assert [r["train_loss"] for r in rounds] == a.train_losses


def test_progress_bar_and_plot(clients: list[ClientDataset], tmp_path: Path) -> None:
    from salus.daemon.services.federated.plot import plot_losses  # matplotlib: seconds

    with round_progress(2, "FedAvg") as on_round:
        result = run(synthetic_model, clients, FedAvg(), 2, seed=0, on_round=on_round, **SETTING)
    path = tmp_path / "loss.png"
    plot_losses({0.0: {"FedAvg": result.train_losses}, 0.9: {"FedAvg": [3.0, 2.0, 1.5]}},
                path, "synthetic(1,1)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
