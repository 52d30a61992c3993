"""Pipeline batch jobs for the pipeline tests: a stack of equal blocks, and entrypoints that
cannot run as a pipeline.

Each layer is a block (Linear + Tanh) of WIDTH x WIDTH; a micro-batch's block costs enough
arithmetic (about 400 MFLOP forward and backward) that a stage's compute outweighs the link to
the next one, so a plan that weighs devices by speed gives a slowed device fewer blocks.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BLOCKS, WIDTH, BATCH, SAMPLES, MICROBATCHES, LR = 6, 1024, 256, 768, 4, 0.01


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(BLOCKS)))


def optimizer(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    return TensorDataset(x, 0.5 * torch.tanh(x.flip(1)))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def make_job():
    m = model()
    return {"state": {"model": m, "opt": optimizer(m)}, "loss": loss,
            "data": DataLoader(data(), batch_size=BATCH, shuffle=True)}


def make_not_sequential():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    net = Net()
    return {"state": {"model": net, "opt": optimizer(net)}, "loss": loss,
            "data": [(torch.zeros(4, 4), torch.zeros(4, 4))]}


def make_one_layer():
    m = nn.Sequential(nn.Linear(4, 4))
    return {"state": {"model": m, "opt": optimizer(m)}, "loss": loss,
            "data": [(torch.zeros(4, 4), torch.zeros(4, 4))]}
