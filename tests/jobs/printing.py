"""A batch job for the job-output tests: it prints one line per iteration."""

import torch
from torch import nn


def make_job():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]
    done = [0]

    def iteration(s, batch):
        x, y = batch
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        s.opt.step()
        print(f"batch iteration {done[0]}")
        done[0] += 1
        return loss

    return {"state": {"model": model, "opt": opt}, "iteration": iteration, "data": data}
