"""A regression gang job large enough for top-k to prune (135,169 parameters, one bucket over
the 2**16 elements below which `sparse_all_reduce` sends dense), dense or at density 0.01 with
error feedback; `evaluate` gives the held-out loss (replica 0's, on samples never trained on).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, SAMPLES, IN, HIDDEN = 32, 512, 64, 2048


def _data(seed: int, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN, generator=g)
    y = (x[:, :8].sum(1, keepdim=True) / 3).tanh() + 0.05 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def initial_loss() -> float:
    """The held-out loss before any training."""
    held_x, held_y = _data(seed=2, samples=512).tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(_model()(held_x), held_y))


def _job(density):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    held_x, held_y = _data(seed=2, samples=512).tensors

    def iteration(s, batch):
        x, y = batch
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        s.comm.all_reduce_gradients(s.model, algorithm="ring", density=density)
        s.opt.step()
        return loss

    def evaluate(s):
        with torch.no_grad():
            return float(nn.functional.mse_loss(s.model(held_x), held_y))

    data = DataLoader(_data(seed=1, samples=SAMPLES), batch_size=BATCH, shuffle=True)
    return {"state": {"model": model, "opt": opt}, "iteration": iteration, "data": data,
            "evaluate": evaluate, "every": 10}


def make_dense():
    return _job(None)


def make_sparse():
    return _job(0.01)
