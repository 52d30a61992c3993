"""FedAvg vs FedProx under system heterogeneity on synthetic(1, 1): the paper's Figure 1 setting.

Usage: .venv/bin/python bench/fedprox.py [--quick] [--rounds R] [--seed S] [--mu0]
                                         [--runner inprocess|daemon] [--plot PATH]

Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020), §5.2: 30 devices of
synthetic(1, 1), K = 10 clients per round, E = 20 local epochs, minibatches of 10, lr 0.01,
200 rounds (40 with --quick), with 0 %, 50 % and 90 % of each round's clients straggling (a
random number of epochs in [1, E)). FedAvg drops the stragglers; FedProx (mu = 1) keeps their
partial work; --mu0 adds FedProx with mu = 0 (partial work, no proximal term). All strategies
see the same data, clients, stragglers and minibatch orders. Training loss is the global
objective f(w) (mean cross-entropy over all training samples, nats); the paper's claim is that
at 90 % stragglers FedProx converges while FedAvg is unstable or worse, so the headline is
final-loss(FedAvg) / final-loss(FedProx) at 90 % (> 1: FedProx ends lower); the same ratio of
the mean loss over the last quarter of the rounds is less sensitive to where an unstable curve
happens to end, and the standard deviation over that quarter measures the instability. A rich
progress bar per run goes to stderr; one JSON object goes to stdout. With --runner daemon the
clients train as scheduled functions of jobs in a salusd started for the run (one CPU device,
two lanes), and the output adds the wall time of one round of 10 clients through the daemon
against the same round one client after another in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from salus.daemon.cli.launch import running_daemon
from salus.daemon.services.federated import (
    ClientDataset,
    ClientRunner,
    FedAvg,
    FederatedResult,
    FedProx,
    InProcessRunner,
    Strategy,
    run,
    synthetic,
    synthetic_model,
)
from salus.daemon.services.federated.plot import plot_losses
from salus.daemon.services.federated.progress import round_progress
from salus.federated.daemon_runner import DaemonRunner

DEVICES, CLIENTS_PER_ROUND, EPOCHS, BATCH, LR, MU = 30, 10, 20, 10, 0.01, 1.0
SHARES = (0.0, 0.5, 0.9)


def tail(losses: list[float]) -> list[float]:
    """The last quarter of a loss curve (at least two rounds)."""
    return losses[-max(2, len(losses) // 4) :]


def _one_round(clients: list[ClientDataset], runner: ClientRunner) -> float:
    """Seconds of one FedProx round of CLIENTS_PER_ROUND clients (no stragglers)."""
    start = time.perf_counter()
    run(synthetic_model, clients, FedProx(MU), 1, clients_per_round=CLIENTS_PER_ROUND,
        epochs=EPOCHS, lr=LR, batch_size=BATCH, straggler_share=0.0, seed=0, runner=runner)
    return round(time.perf_counter() - start, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 rounds instead of 200")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="data, model and sampling seed")
    parser.add_argument("--mu0", action="store_true", help="also run FedProx with mu = 0")
    parser.add_argument("--runner", choices=["inprocess", "daemon"], default="inprocess",
                        help="train clients in this process, or as functions of jobs in a "
                        "salusd started for the run (CPU, 1 device, 2 lanes)")
    parser.add_argument("--plot", metavar="PATH", help="write the Figure 1 layout here (png/pdf)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (40 if args.quick else 200)
    clients = synthetic(1.0, 1.0, devices=DEVICES, seed=args.seed)
    strategies: list[Strategy] = [FedAvg(), FedProx(MU)] + ([FedProx(0.0)] if args.mu0 else [])
    results: dict[float, dict[str, FederatedResult]] = {}
    seconds: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        runner: ClientRunner = InProcessRunner(clients)
        one_round: dict[str, float] = {}
        if args.runner == "daemon":
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="salusd-fed-")))
            daemon = stack.enter_context(running_daemon(
                tmp / "salusd.sock", state_dir=tmp, cpu_threads=1, cpu_memory="2G"))
            runner = stack.enter_context(DaemonRunner(clients, daemon.address, lanes=2))
            one_round = {name: _one_round(clients, r) for name, r in
                         (("inprocess", InProcessRunner(clients)), ("daemon", runner))}
        for share in SHARES:
            for strategy in strategies:
                label = f"{strategy.name}, {share:.0%} stragglers"
                start = time.perf_counter()
                with round_progress(rounds, label) as on_round:
                    result = run(
                        synthetic_model,
                        clients,
                        strategy,
                        rounds,
                        clients_per_round=CLIENTS_PER_ROUND,
                        epochs=EPOCHS,
                        lr=LR,
                        batch_size=BATCH,
                        straggler_share=share,
                        seed=args.seed,
                        runner=runner,
                        on_round=on_round,
                    )
                results.setdefault(share, {})[strategy.name] = result
                seconds.setdefault(f"{share:.0%}", {})[strategy.name] = round(
                    time.perf_counter() - start, 2
                )
    losses = {s: {n: r.train_losses for n, r in by.items()} for s, by in results.items()}
    if args.plot:
        plot_losses(losses, args.plot, "synthetic(1,1)")
        print(f"wrote {args.plot}", file=sys.stderr)
    final = {f"{s:.0%}": {n: round(v[-1], 4) for n, v in by.items()} for s, by in losses.items()}
    fedavg, fedprox = FedAvg().name, FedProx(MU).name
    ratio = losses[0.9][fedavg][-1] / losses[0.9][fedprox][-1]
    tail_ratio = statistics.mean(tail(losses[0.9][fedavg])) / statistics.mean(
        tail(losses[0.9][fedprox])
    )
    out: dict[str, Any] = {
        "bench": "fedprox",
        "setting": {
            "data": "synthetic(1,1)",
            "devices": DEVICES,
            "train_samples": sum(c.num_train for c in clients),
            "clients_per_round": CLIENTS_PER_ROUND,
            "epochs": EPOCHS,
            "batch_size": BATCH,
            "lr": LR,
            "mu": MU,
            "rounds": rounds,
            "seed": args.seed,
            "runner": args.runner,
        },
        "one_round_seconds": one_round or None,
        "one_round_daemon_over_inprocess": (
            round(one_round["daemon"] / one_round["inprocess"], 3) if one_round else None),
        "final_train_loss": final,
        "final_loss_ratio_fedavg_vs_fedprox_90pct": round(ratio, 4),
        "fedprox_lower_at_90pct": ratio > 1.0,
        "last_quarter_mean_loss_ratio_fedavg_vs_fedprox_90pct": round(tail_ratio, 4),
        "last_quarter_loss_std": {
            f"{s:.0%}": {n: round(statistics.pstdev(tail(v)), 4) for n, v in by.items()}
            for s, by in losses.items()
        },
        "final_test_accuracy": {
            f"{s:.0%}": {n: round(r.test_accuracies[-1], 4) for n, r in by.items()}
            for s, by in results.items()
        },
        "seconds": seconds,
        "train_loss_per_round": {
            f"{s:.0%}": {n: [round(x, 5) for x in v] for n, v in by.items()}
            for s, by in losses.items()
        },
        "test_accuracy_per_round": {
            f"{s:.0%}": {n: [round(x, 4) for x in r.test_accuracies] for n, r in by.items()}
            for s, by in results.items()
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
