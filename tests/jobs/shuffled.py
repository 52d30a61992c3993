"""A batch job for the REST tests: dropout and a shuffling DataLoader, so resuming it exactly
needs both the job's random state and the data order restored."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(10, 8, generator=g),
                                    torch.randn(10, 1, generator=g)), batch_size=4,
                      shuffle=True)

    def iteration(s, batch):
        x, y = batch
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        s.opt.step()
        s.sched.step()
        return loss

    def evaluate(s):
        return float(sum(p.abs().sum() for p in s.model.parameters()))

    return {"state": {"model": model, "opt": opt, "sched": sched}, "iteration": iteration,
            "data": data, "evaluate": evaluate, "every": 10}


def run_directly(iterations):
    """The same job as a plain loop in this process: the reference a resumed run must equal."""
    job = make_job()

    class S:
        pass

    s = S()
    for name, obj in job["state"].items():
        setattr(s, name, obj)
    it = None
    done = 0
    while done < iterations:
        if it is None:
            it = iter(job["data"])
        try:
            batch = next(it)
        except StopIteration:
            it = None
            continue
        job["iteration"](s, batch)
        done += 1
    return job["state"]["model"]
