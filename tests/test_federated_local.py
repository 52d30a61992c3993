"""Pieces of a round checked alone: aggregation, strategies' rules, stragglers' budgets, the
proximal gradient and local training, each against an independent hand computation."""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from salus.daemon.services.federated import (
    ClientDataset,
    ClientTask,
    ClientUpdate,
    FedAvg,
    FedProx,
    epoch_budgets,
    synthetic,
    synthetic_model,
    train_client,
    weighted_average,
)
from salus.daemon.services.federated.proximal import add_proximal_gradient_

torch.set_num_threads(1)


def test_weighted_average_matches_a_hand_computation() -> None:
    a = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([1.0]),
         "n": torch.tensor(1)}
    b = {"w": torch.tensor([[5.0, 6.0], [7.0, 8.0]]), "b": torch.tensor([3.0]),
         "n": torch.tensor(4)}
    before = copy.deepcopy([a, b])
    out = weighted_average([a, b], [1, 3])
    # (1*a + 3*b) / 4, worked out by hand
    assert torch.equal(out["w"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(out["b"], torch.tensor([2.5]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 3  # 13 / 4 = 3.25, rounded
    assert out["w"].dtype == torch.float32
    assert all(torch.equal(x[k], y[k]) for x, y in zip([a, b], before, strict=True) for k in x)


def test_weighted_average_refuses_bad_input() -> None:
    s = {"w": torch.zeros(2)}
    with pytest.raises(ValueError):
        weighted_average([], [])
    with pytest.raises(ValueError):
        weighted_average([s, s], [0, 0])
    with pytest.raises(ValueError):
        weighted_average([s, {"v": torch.zeros(2)}], [1, 1])


def test_fedavg_drops_stragglers_and_fedprox_keeps_their_partial_work() -> None:
    assert FedAvg().local_epochs(20, 20) == 20
    assert FedAvg().local_epochs(20, 7) == 0
    assert FedProx(1.0).local_epochs(20, 7) == 7
    assert FedProx(1.0).local_epochs(20, 20) == 20
    assert FedAvg().mu == 0.0 and FedProx(0.5).mu == 0.5


def test_fedprox_weighs_partial_work_by_samples_not_epochs() -> None:
    full = ClientUpdate(0, {"w": torch.tensor([2.0])}, num_samples=30, epochs=20)
    partial = ClientUpdate(1, {"w": torch.tensor([6.0])}, num_samples=10, epochs=3)
    out = FedProx(1.0).aggregate({"w": torch.tensor([0.0])}, [full, partial])
    assert torch.allclose(out["w"], torch.tensor([(30 * 2.0 + 10 * 6.0) / 40]))


def test_a_round_without_updates_keeps_the_global_model() -> None:
    global_state = {"w": torch.tensor([1.5])}
    assert torch.equal(FedAvg().aggregate(global_state, [])["w"], global_state["w"])


def test_clients_are_sampled_uniformly_without_repeats() -> None:
    rng = np.random.default_rng(0)
    counts: Counter[int] = Counter()
    for _ in range(3000):
        chosen = FedAvg().select(30, 10, rng)
        assert len(set(chosen)) == 10 and chosen == sorted(chosen)
        counts.update(chosen)
    # each client is expected in 1000 of 3000 rounds (sd ~26)
    assert set(counts) == set(range(30))
    assert all(850 < n < 1150 for n in counts.values())


@pytest.mark.parametrize(("share", "stragglers"), [(0.0, 0), (0.5, 5), (0.9, 9)])
def test_a_share_of_clients_get_budgets_below_e(share: float, stragglers: int) -> None:
    rng = np.random.default_rng(1)
    seen: set[int] = set()
    for _ in range(200):
        budgets = epoch_budgets(list(range(10, 20)), 20, share, rng)
        assert sorted(budgets) == list(range(10, 20))
        short = [b for b in budgets.values() if b < 20]
        assert len(short) == stragglers
        assert all(1 <= b < 20 for b in short)
        seen.update(short)
    assert seen == (set(range(1, 20)) if stragglers else set())


def test_stragglers_need_at_least_two_epochs() -> None:
    with pytest.raises(ValueError, match="E must be >= 2"):
        epoch_budgets([0, 1], 1, 0.5, np.random.default_rng(0))


def test_proximal_gradient_equals_autograd_of_the_term() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen, requires_grad=True)
    w_t = torch.randn(4, 3, generator=gen)
    mu = 0.7
    (mu / 2 * ((w - w_t) ** 2).sum()).backward()
    assert w.grad is not None
    autograd = w.grad.clone()
    assert torch.allclose(autograd, mu * (w.detach() - w_t))
    w.grad = None
    add_proximal_gradient_([w], [w_t], mu)
    assert torch.allclose(_grad(w), autograd)
    g = torch.randn(4, 3, generator=gen)
    w.grad = g.clone()
    add_proximal_gradient_([w], [w_t], mu)
    assert torch.allclose(_grad(w), g + autograd)


def _grad(w: torch.Tensor) -> torch.Tensor:
    assert w.grad is not None
    return w.grad


def _tiny_client(samples: int = 12) -> ClientDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 60, generator=gen)
    y = torch.randint(0, 10, (samples,), generator=gen)
    return ClientDataset(x, y, x[:2], y[:2])


def _shifted_global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {k: v.detach().clone() for k, v in synthetic_model().state_dict().items()}


def test_local_training_is_sgd_on_cross_entropy_plus_the_proximal_term() -> None:
    client, global_state, mu, lr = _tiny_client(), _shifted_global_state(), 2.0, 0.3
    # two full-batch epochs = two SGD steps; the second sees a nonzero proximal term
    task = ClientTask(0, global_state, synthetic_model, epochs=2, mu=mu, lr=lr,
                      batch_size=100, seed=11)
    update = train_client(task, client)
    w = global_state["weight"].clone().requires_grad_(True)
    b = global_state["bias"].clone().requires_grad_(True)
    for _ in range(2):
        prox = mu / 2 * (((w - global_state["weight"]) ** 2).sum()
                         + ((b - global_state["bias"]) ** 2).sum())
        loss = F.cross_entropy(client.x_train @ w.T + b, client.y_train) + prox
        gw, gb = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            w -= lr * gw
            b -= lr * gb
    assert torch.allclose(update.state["weight"], w.detach(), atol=1e-6)
    assert torch.allclose(update.state["bias"], b.detach(), atol=1e-6)
    assert (update.client_id, update.num_samples, update.epochs) == (0, 12, 2)


def test_local_training_is_seeded_and_leaves_the_callers_random_state() -> None:
    client, global_state = _tiny_client(40), _shifted_global_state()
    task = ClientTask(5, global_state, synthetic_model, epochs=3, mu=0.5, lr=0.05,
                      batch_size=7, seed=1)
    before = torch.get_rng_state()
    first, second = train_client(task, client), train_client(task, client)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first.state["weight"], second.state["weight"])
    other = train_client(ClientTask(5, global_state, synthetic_model, epochs=3, mu=0.5,
                                    lr=0.05, batch_size=7, seed=2), client)
    assert not torch.equal(first.state["weight"], other.state["weight"])


def test_a_task_ships_to_another_process() -> None:
    client = synthetic(1.0, 1.0, devices=1, seed=2)[0]
    task = ClientTask(0, _shifted_global_state(), synthetic_model, epochs=2, mu=1.0, lr=0.01,
                      batch_size=10, seed=4)
    assert pickle.loads(pickle.dumps(task)).seed == 4
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        remote = pool.submit(train_client, task, client).result(timeout=120)
    local = train_client(task, client)
    assert all(torch.equal(remote.state[k], local.state[k]) for k in local.state)


def test_bad_tasks_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one epoch"):
        ClientTask(0, {}, synthetic_model, epochs=0, mu=0.0, lr=0.1, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="mu"):
        FedProx(-1.0)
