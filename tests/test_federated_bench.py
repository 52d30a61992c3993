"""bench/fedprox.py end to end at two rounds (one JSON object on stdout holding the losses the
library computes for the bench's setting, the plot on disk), and the bench's claim on its own
setting: at 90 % stragglers FedProx (mu = 1) ends with a lower global loss than FedAvg."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from salus.daemon.services.federated import (
    ClientDataset,
    FedAvg,
    FederatedResult,
    FedProx,
    Strategy,
    run,
    synthetic,
    synthetic_model,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """bench/fedprox.py as a module, for its constants (the paper's setting)."""
    spec = importlib.util.spec_from_file_location("bench_fedprox", ROOT / "bench" / "fedprox.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench: ModuleType, strategy: Strategy, rounds: int, share: float, seed: int
         ) -> tuple[list[ClientDataset], FederatedResult]:
    torch.set_num_threads(1)
    clients = synthetic(1.0, 1.0, devices=bench.DEVICES, seed=seed)
    return clients, run(synthetic_model, clients, strategy, rounds,
                        clients_per_round=bench.CLIENTS_PER_ROUND, epochs=bench.EPOCHS,
                        lr=bench.LR, batch_size=bench.BATCH, straggler_share=share, seed=seed)


def _global_loss(state: dict[str, torch.Tensor], clients: list[ClientDataset]) -> float:
    """Mean cross-entropy (nats per sample) over every client's training samples, by hand:
    log-sum-exp of the logits minus the true class's logit."""
    x = torch.cat([c.x_train for c in clients]).double()
    y = torch.cat([c.y_train for c in clients])
    logits = x @ state["weight"].double().T + state["bias"].double()
    return float((torch.logsumexp(logits, dim=1) - logits[torch.arange(len(y)), y]).mean())


def test_bench_prints_one_json_object_and_writes_the_plot(tmp_path: Path,
                                                          bench: ModuleType) -> None:
    plot = tmp_path / "fig1.png"
    proc = subprocess.run(
        [sys.executable, "bench/fedprox.py", "--rounds", "2", "--plot", str(plot)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    losses = out["train_loss_per_round"]
    assert set(losses) == {"0%", "50%", "90%"}
    assert all(len(v) == 3 for by in losses.values() for v in by.values())
    for strategy in (FedAvg(), FedProx(bench.MU)):
        _, expected = _run(bench, strategy, 2, 0.9, 0)
        assert losses["90%"][strategy.name] == pytest.approx(expected.train_losses, abs=1e-5)
    assert out["final_loss_ratio_fedavg_vs_fedprox_90pct"] == pytest.approx(
        losses["90%"]["FedAvg"][-1] / losses["90%"]["FedProx (mu=1)"][-1], abs=1e-3)
    assert plot.stat().st_size > 0


def test_fedprox_ends_lower_than_fedavg_at_90pct_stragglers(bench: ModuleType) -> None:
    rounds = 20  # enough for FedAvg's instability to show (a few seconds on one core)
    final: dict[str, float] = {}
    for strategy in (FedAvg(), FedProx(bench.MU)):
        clients, result = _run(bench, strategy, rounds, 0.9, 0)
        final[strategy.name] = _global_loss(result.final_state, clients)
        assert result.train_losses[-1] == pytest.approx(final[strategy.name], rel=1e-4)
        initial = result.train_losses[0]
    fedavg, fedprox = final[FedAvg().name], final[FedProx(bench.MU).name]
    assert fedprox < 0.5 * initial, final  # FedProx converges ...
    assert fedprox < fedavg / 1.5, final  # ... where FedAvg, fed by one client a round, does not
