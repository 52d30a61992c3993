"""Seeded models and data shared by the daemon tests (imported by test modules)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Build = Callable[[], tuple[nn.Module, torch.optim.Optimizer, nn.Module]]


def mlp(opt: str = "sgd") -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return m, _optimizer(m, opt), nn.CrossEntropyLoss()


def cnn(opt: str = "adam") -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 3),
    )
    return m, _optimizer(m, opt), nn.CrossEntropyLoss()


def _optimizer(m: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.Adam(m.parameters(), lr=1e-2)


def batches(kind: str, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
                for _ in range(n)]
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def train_direct(build: Build, data: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    model, opt, loss_fn = build()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model
