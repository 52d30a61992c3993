"""Early stopping on the validation loss, with ReduceLROnPlateau and the best weights restored.

The common loop: after each epoch compute the validation loss, `scheduler.step(val_loss)`, keep
a copy of the best `state_dict()`, stop after `PATIENCE` epochs without improvement and load the
best weights back. Noisy labels on a small training set make it overfit, so it does stop.
Through salusd the best weights are fetched from the job when they improve.
Run: `python early_stopping.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "early stopping on validation loss, ReduceLROnPlateau(val_loss), best weights restored"
SALUS_LINES_CHANGED = 17
MAX_EPOCHS = 40
PATIENCE = 4


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: ReduceLROnPlateau,
               train_loader: DataLoader, val_loader: DataLoader) -> int:
    loss_fn = nn.MSELoss()
    best_loss, best_state, bad_epochs = float("inf"), None, 0
    for epoch in range(MAX_EPOCHS):
        model.train()
        for inputs, targets in train_loader:
            optimizer.zero_grad()
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = sum(loss_fn(model(x), y).item() for x, y in val_loader) / len(val_loader)
        scheduler.step(val_loss)
        if val_loss < best_loss:
            best_loss, best_state, bad_epochs = val_loss, copy.deepcopy(model.state_dict()), 0
        else:
            bad_epochs += 1
            if bad_epochs >= PATIENCE:
                print(f"no improvement for {PATIENCE} epochs: stopping after epoch {epoch}")
                break
    print(f"best val loss {best_loss:.4f}, lr {optimizer.param_groups[0]['lr']:.2e}")
    model.load_state_dict(best_state)
    return epoch


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: ReduceLROnPlateau, train_loader: DataLoader,
              val_loader: DataLoader) -> int:
    loss_fn = nn.MSELoss()
    best_loss, best_state, bad_epochs = float("inf"), None, 0
    with salus.connect(name="early-stop", iterations=MAX_EPOCHS * len(train_loader),
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer, scheduler=scheduler)

        @remote.iteration
        def train(s, inputs, targets):
            s.model.train()
            s.optimizer.zero_grad()
            loss_fn(s.model(inputs), targets).backward()
            s.optimizer.step()

        @remote.function
        def validate(s, inputs, targets):
            s.model.eval()
            with torch.no_grad():
                return loss_fn(s.model(inputs), targets).item()

        for epoch in range(MAX_EPOCHS):
            for inputs, targets in train_loader:
                train(inputs, targets)
            val_loss = sum(validate(x, y) for x, y in val_loader) / len(val_loader)
            remote.call(lambda s, loss: s.scheduler.step(loss), val_loss)
            if val_loss < best_loss:
                best_loss, best_state, bad_epochs = val_loss, job.state_dict(), 0
            else:
                bad_epochs += 1
                if bad_epochs >= PATIENCE:
                    print(f"no improvement for {PATIENCE} epochs: stopping after epoch {epoch}")
                    break
        remote.pull()
    print(f"best val loss {best_loss:.4f}, lr {optimizer.param_groups[0]['lr']:.2e}")
    model.load_state_dict(best_state)
    return epoch


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(10)
    torch.set_num_threads(1)
    weights = torch.randn(10, 1)
    inputs = torch.randn(160, 10)
    targets = inputs @ weights + 1.5 * torch.randn(160, 1)
    train_loader = DataLoader(TensorDataset(inputs[:64], targets[:64]), batch_size=16,
                              shuffle=True)
    val_loader = DataLoader(TensorDataset(inputs[64:], targets[64:]), batch_size=48)
    model = nn.Sequential(nn.Linear(10, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=1)
    if address is None:
        stopped = run_direct(model, optimizer, scheduler, train_loader, val_loader)
    else:
        stopped = run_salus(address, model, optimizer, scheduler, train_loader, val_loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "stopped_epoch": stopped}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
