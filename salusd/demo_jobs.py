"""The demo's workload: three training jobs and one inference job, each runnable directly (the
baseline) or as a client of a running daemon (`python -m salus.daemon.demo_jobs NAME ADDRESS`).

Every job is seeded, so a direct run and a daemon run see the same data and the same model.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    iterations: int
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer | None, Any]]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def _mlp(width: int, depth: int, inputs: int = 64, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, classes))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
    )


def _mlp_sgd() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _mlp(256, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss()


def _cnn_adam() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _cnn()
    return m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.CrossEntropyLoss()


def _mlp_adam() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _mlp(512, 1)
    return m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.CrossEntropyLoss()


def _mlp_infer() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    return _mlp(512, 3).eval(), None, None


def _vectors(g: torch.Generator, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 64, generator=g)
    return x, (x[:, :10].sum(dim=1) > 0).long() + 2 * (x[:, 10:20].sum(dim=1) > 0).long()


def _images(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 1, 28, 28, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long()


WORKLOADS = {
    w.name: w
    for w in (
        Workload("mlp-sgd", "training", 150, _mlp_sgd, _vectors),
        Workload("cnn-adam", "training", 60, _cnn_adam, _images),
        Workload("mlp-adam", "training", 120, _mlp_adam, _vectors),
        Workload("mlp-infer", "inference", 200, _mlp_infer, lambda g: _vectors(g, 128)),
    )
}


def run_direct(w: Workload) -> dict[str, Any]:
    """The job's loop in this process, without the daemon (the baseline)."""
    torch.manual_seed(0)
    model, opt, loss_fn = w.build()
    g = torch.Generator().manual_seed(1)
    batches = [w.batch(g) for _ in range(w.iterations)]
    start = time.perf_counter()
    loss = None
    for x, y in batches:
        if opt is None:
            with torch.inference_mode():
                model(x)
            continue
        opt.zero_grad()
        out = loss_fn(model(x), y)
        out.backward()
        opt.step()
        loss = float(out)
    return {"name": w.name, "seconds": time.perf_counter() - start, "final_loss": loss}


def run_client(w: Workload, address: str) -> dict[str, Any]:
    """The same loop through the daemon, as a training script would write it."""
    import salus.adapters.torch as salus

    torch.manual_seed(0)
    model, opt, loss_fn = w.build()
    g = torch.Generator().manual_seed(1)
    batches = [w.batch(g) for _ in range(w.iterations)]
    start_wall = time.time()
    start = time.perf_counter()
    loss = None
    with salus.connect(name=w.name, iterations=w.iterations, address=address) as job:
        if opt is None:
            infer = job.inference(model)
            for x, _ in batches:
                infer(x)
        else:
            step = job.train_step(model, opt, loss_fn)
            for x, y in batches:
                loss = step(x, y)
        info = job.info()
    end = time.perf_counter()
    return {
        "name": w.name,
        "kind": w.kind,
        "iterations": w.iterations,
        "start_wall": start_wall,
        "end_wall": start_wall + (end - start),
        "jct_s": end - start,
        "mean_iteration_s": info.get("mean_iteration_s"),
        "device": info.get("device"),
        "lane": info.get("lane"),
        "final_loss": loss,
    }


def main() -> None:
    """Client process: import and build, say `ready`, wait for `go` on stdin, run, print JSON."""
    workload = WORKLOADS[sys.argv[1]]
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(run_client(workload, sys.argv[2])), flush=True)


if __name__ == "__main__":
    main()
