"""A gang job reading its samples through the node's data cache (`salus.data`).

The samples are files in `samples/` beside this file, 33 float32 each (32 features and a
target). `make_job` reads them with a `CachedDataset` and a `ReplicaLoader`: each replica reads
its half of every batch, each file once from the source in the gang, and epochs after the
first are served from the replicas' memory (level 2). `run_directly` trains the same model on
the same batches in one process, as the reference.
"""

import os
from pathlib import Path

import torch
from torch import nn

from salus.data import CachedDataset, ReplicaLoader

SAMPLES, FEATURES, BATCH = 64, 32, 16
HERE = os.path.dirname(os.path.abspath(__file__))


def write_samples(folder: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x[:, :4].sum(1, keepdim=True).tanh()
    os.makedirs(folder, exist_ok=True)
    for i, row in enumerate(torch.cat([x, y], dim=1)):
        with open(os.path.join(folder, f"{i:04d}.bin"), "wb") as f:
            f.write(row.numpy().tobytes())


def decode(raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    row = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    return row[:FEATURES], row[FEATURES:]


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_job():
    model, opt = _model()
    data = ReplicaLoader(CachedDataset(os.path.join(HERE, "samples"), decode), BATCH)

    def iteration(s, batch):
        x, y = batch
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        s.comm.all_reduce_gradients(s.model, algorithm="ring")
        s.opt.step()
        return loss

    return {"state": {"model": model, "opt": opt}, "iteration": iteration, "data": data}


def run_directly(folder: str, iterations: int) -> nn.Module:
    """One process, whole batches in the order a ReplicaLoader draws (one randperm per epoch
    from the global generator)."""
    model, opt = _model()
    rows = [decode(Path(folder, f).read_bytes()) for f in sorted(os.listdir(folder))]
    done = 0
    while done < iterations:
        order = torch.randperm(SAMPLES)
        for start in range(0, SAMPLES, BATCH):
            if done == iterations:
                break
            x = torch.stack([rows[i][0] for i in order[start:start + BATCH]])
            y = torch.stack([rows[i][1] for i in order[start:start + BATCH]])
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            done += 1
    return model
