"""Federated rounds through the real daemon give the global model of the plain in-process loop:
the daemon adds sharing (clients as scheduled functions in parallel lanes), not a different
algorithm. One daemon serves the module's runs in turn."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from daemon_proc import RunningDaemon, salusd

from salus.daemon.services.federated import (
    FedAvg,
    FedProx,
    InProcessRunner,
    run,
    synthetic,
    synthetic_model,
)
from salus.federated.daemon_runner import DaemonRunner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with salusd(tmp_path_factory.mktemp("salusd"), devices=1) as running:
        yield running


@pytest.mark.parametrize("strategy", [FedAvg(), FedProx(1.0)], ids=["fedavg", "fedprox"])
def test_three_rounds_through_the_daemon_equal_the_in_process_loop(
        daemon: RunningDaemon, strategy: FedAvg) -> None:
    torch.set_num_threads(1)  # the executors run one intra-op thread (--cpu-threads 1)
    clients = synthetic(1.0, 1.0, devices=12, seed=3)
    settings = dict(clients_per_round=5, epochs=4, lr=0.01, batch_size=10,
                    straggler_share=0.5, seed=3)
    direct = run(synthetic_model, clients, strategy, 3, runner=InProcessRunner(clients),
                 **settings)
    with DaemonRunner(clients, daemon.address, lanes=2) as runner:
        shared = run(synthetic_model, clients, strategy, 3, runner=runner, **settings)
    assert daemon.proc.poll() is None
    assert shared.train_losses == direct.train_losses
    for key, value in direct.final_state.items():
        assert torch.equal(shared.final_state[key], value), key


def test_the_public_run_trains_clients_in_the_daemon(daemon: RunningDaemon) -> None:
    import salus.federated as fed

    torch.set_num_threads(1)
    clients = fed.synthetic(1.0, 1.0, devices=6, seed=5)
    settings = dict(clients_per_round=3, epochs=2, lr=0.01, batch_size=10, seed=5)
    direct = fed.run(fed.synthetic_model, clients, fed.FedProx(1.0), 2,
                     runner=fed.InProcessRunner(clients), **settings)
    shared = fed.run(fed.synthetic_model, clients, fed.FedProx(1.0), 2, address=daemon.address,
                     **settings)
    assert shared.train_losses == direct.train_losses
