"""Save a general checkpoint, rebuild everything from it, and resume training.

The PyTorch recipe "saving and loading a general checkpoint": after some epochs save the model,
optimizer and scheduler `state_dict()`s (and the random state, so the shuffling resumes where
it was), then build new objects, `load_state_dict` them and continue. Through salusd the first
phase ends with `remote.pull()` and the second phase attaches the new objects to a new job.
Run: `python checkpoint_resume.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "checkpoint (model, optimizer, scheduler, RNG) -> new objects -> load -> resume"
SALUS_LINES_CHANGED = 16
EPOCHS_BEFORE, EPOCHS_AFTER = 2, 2


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Dropout(0.1), nn.Linear(48, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
    return model, optimizer, scheduler


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, loader: DataLoader,
               first_epoch: int, epochs: int, checkpoint_path: str) -> None:
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(first_epoch, first_epoch + epochs):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), labels)
            loss.backward()
            optimizer.step()
        scheduler.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.5f}")
    torch.save({"epoch": first_epoch + epochs, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(),
                "rng_state": torch.get_rng_state()}, checkpoint_path)


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler, loader: DataLoader,
              first_epoch: int, epochs: int, checkpoint_path: str) -> None:
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    with salus.connect(name=f"resume-from-{first_epoch}", iterations=epochs * len(loader),
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer, scheduler=scheduler)

        @remote.iteration
        def train(s, inputs, labels):
            s.optimizer.zero_grad()
            loss = loss_fn(s.model(inputs), labels)
            loss.backward()
            s.optimizer.step()
            return loss

        @remote.function
        def end_epoch(s):
            s.scheduler.step()
            return s.scheduler.get_last_lr()[0]

        for epoch in range(first_epoch, first_epoch + epochs):
            for inputs, labels in loader:
                loss = train(inputs, labels)
            lr = end_epoch()
            print(f"epoch {epoch}: loss {loss.item():.4f}, lr {lr:.5f}")
        remote.pull()
    torch.save({"epoch": first_epoch + epochs, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(),
                "rng_state": torch.get_rng_state()}, checkpoint_path)


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(9)
    torch.set_num_threads(1)
    centers = torch.randn(3, 12)
    labels = torch.randint(0, 3, (256,))
    loader = DataLoader(TensorDataset(centers[labels] + torch.randn(256, 12), labels),
                        batch_size=32, shuffle=True)
    checkpoint_path = f"{out_path}.checkpoint"

    model, optimizer, scheduler = build()
    if address is None:
        run_direct(model, optimizer, scheduler, loader, 0, EPOCHS_BEFORE, checkpoint_path)
    else:
        run_salus(address, model, optimizer, scheduler, loader, 0, EPOCHS_BEFORE,
                  checkpoint_path)
    del model, optimizer, scheduler

    checkpoint = torch.load(checkpoint_path)
    model, optimizer, scheduler = build()
    model.load_state_dict(checkpoint["model_state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
    torch.set_rng_state(checkpoint["rng_state"])
    if address is None:
        run_direct(model, optimizer, scheduler, loader, checkpoint["epoch"], EPOCHS_AFTER,
                   checkpoint_path)
    else:
        run_salus(address, model, optimizer, scheduler, loader, checkpoint["epoch"],
                  EPOCHS_AFTER, checkpoint_path)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
