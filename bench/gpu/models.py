"""The kit's models and batches, seeded, so a run through salusd and a direct one see the same
numbers. Sizes: `width` units per layer, `batch` rows."""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int, layers: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def batch(width: int, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
