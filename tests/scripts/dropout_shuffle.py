"""Dropout in the model, a shuffling DataLoader and noise augmentation on the client.

A tabular classifier as in the PyTorch tutorials: `DataLoader(shuffle=True)` draws its order
from torch's global generator, the client adds Gaussian noise to each batch, and dropout in the
model draws masks. A direct run interleaves the three draws on one generator; through salusd
the dropout runs in the daemon and the stream must still come out the same.
Run: `python dropout_shuffle.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "dropout in the daemon, shuffling DataLoader and noise augmentation on the client"
SALUS_LINES_CHANGED = 10
EPOCHS = 3


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(64, 3),
    )


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> None:
    criterion = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(EPOCHS):
        running_loss = 0.0
        for inputs, labels in loader:
            inputs = inputs + 0.1 * torch.randn_like(inputs)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              loader: DataLoader) -> None:
    criterion = nn.CrossEntropyLoss()
    model.train()
    with salus.connect(name="dropout", iterations=EPOCHS * len(loader), address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer)

        @remote.iteration
        def train(s, inputs, labels):
            s.optimizer.zero_grad()
            outputs = s.model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            s.optimizer.step()
            return loss

        for epoch in range(EPOCHS):
            running_loss = 0.0
            for inputs, labels in loader:
                inputs = inputs + 0.1 * torch.randn_like(inputs)
                loss = train(inputs, labels)
                running_loss += loss.item()
            print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(2)
    torch.set_num_threads(1)
    centers = 2 * torch.randn(3, 20)
    labels = torch.randint(0, 3, (384,))
    features = centers[labels] + torch.randn(384, 20)
    loader = DataLoader(TensorDataset(features, labels), batch_size=32, shuffle=True)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if address is None:
        run_direct(model, optimizer, loader)
    else:
        run_salus(address, model, optimizer, loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
