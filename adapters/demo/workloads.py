"""The demo's workloads: small seeded models and their batches, in plain PyTorch.

Both the demo's client processes (`jobs.py`) and its unchanged training script (`train.py`) build
their models and batches here, so a direct run and a daemon run see the same data and the same
model. This module imports torch and nothing of salusd.
"""

from __future__ import annotations

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
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


def _mlp_sgd() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _mlp(1024, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss()


def _cnn_adam() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _cnn()
    return m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.CrossEntropyLoss()


def _mlp_adam() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _mlp(1024, 2)
    return m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.CrossEntropyLoss()


def _small_mlp() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    m = _mlp(128, 1)
    return m, torch.optim.SGD(m.parameters(), lr=0.05), nn.CrossEntropyLoss()


def _wide_infer() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    return _mlp(2048, 2).eval(), None, None  # about 17 MiB of parameters


def _mlp_infer() -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    return _mlp(1024, 3).eval(), None, None


def _vectors(g: torch.Generator, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 64, generator=g)
    return x, (x[:, :10].sum(dim=1) > 0).long() + 2 * (x[:, 10:20].sum(dim=1) > 0).long()


def _images(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 1, 28, 28, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long()


WORKLOADS = {
    w.name: w
    for w in (
        Workload("mlp-sgd", "training", 100, _mlp_sgd, lambda g: _vectors(g, 256)),
        Workload("cnn-adam", "training", 60, _cnn_adam, _images),
        Workload("mlp-adam", "training", 100, _mlp_adam, lambda g: _vectors(g, 256)),
        Workload("mlp-infer", "inference", 150, _mlp_infer, lambda g: _vectors(g, 512)),
        Workload("small-mlp", "training", 200, _small_mlp, lambda g: _vectors(g, 32)),
        Workload("infer-mlp", "inference", 20, _wide_infer, lambda g: _vectors(g, 32)),
    )
}
