"""Pipeline split: stage modules keep the model's names; a model trained as a 3-process GPipe
pipeline at a sky plan's boundaries ends with the parameters of the unsplit model trained with
the same micro-batching."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from salus.daemon.services.placement import (
    CostModel,
    DeviceProfile,
    allocate_sky,
    heterogeneous_cluster,
    profile_model,
    split_model,
    train_pipelined,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
MICRO = 4
STEPS = 3
LR = 0.05


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
        nn.Tanh(), nn.Linear(16, 2),
    ).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64),
             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def test_split_keeps_names_and_shares_modules() -> None:
    model = make_model()
    stages = split_model(model, [0, 2, 5, 7])
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2", "3", "4"], ["5", "6"]]
    assert stages[1][0] is model[2]
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    x = torch.randn(3, 6, dtype=torch.float64)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, model(x))


@pytest.mark.parametrize("bad", [[0, 7], [1, 7], [0, 3, 3, 7], [0, 8]])
def test_split_refuses_bad_boundaries(bad: list[int]) -> None:
    if bad == [0, 7]:
        assert len(split_model(make_model(), bad)) == 1
        return
    with pytest.raises(ValueError, match="boundaries"):
        split_model(make_model(), bad)


def unsplit_reference(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[nn.Module,
                                                                              list[float]]:
    """The same training in one process: each step's loss is the mean over micro-batches."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        parts = [nn.functional.mse_loss(model(xm), ym)
                 for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)]
        loss = torch.stack(parts).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.slow
def test_pipelined_training_equals_unsplit_training() -> None:
    model = make_model()
    profile = profile_model(model, batches()[0][0])
    base = DeviceProfile("cpu", 1e9, 1e9, 2**20)
    cluster = heterogeneous_cluster(base, 3, latency_s=1e-5, bandwidth_bytes_per_s=1e9, seed=0)
    plan = allocate_sky(CostModel(profile, cluster))
    data = batches()
    result = train_pipelined(make_model, plan.boundaries, data, nn.MSELoss(),
                             functools.partial(torch.optim.SGD, lr=LR), MICRO, timeout_s=120)
    reference, losses = unsplit_reference(data)
    assert result.losses == pytest.approx(losses, abs=1e-12)
    state = reference.state_dict()
    assert sorted(result.state) == sorted(state)
    for name, value in state.items():
        assert (result.state[name] - value).abs().max().item() <= 1e-6, name
    # The training moved the parameters: the comparison is not of two untouched models.
    assert any(not torch.equal(v, make_model().state_dict()[k]) for k, v in state.items())
