"""Gradient accumulation over micro-batches, as in the usual "effective batch size" recipe.

The loss of each micro-batch is divided by the number of accumulation steps and backpropagated;
every `ACCUMULATION_STEPS` micro-batches the optimizer steps (after clipping) and the gradients
are zeroed, and a linear warm-up `LambdaLR` steps with it. Through salusd each micro-batch is one
call and the gradients accumulate in the job between calls.
Run: `python grad_accumulation.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "gradient accumulation: backward per micro-batch, clip + AdamW + warm-up every 4th"
SALUS_LINES_CHANGED = 16
EPOCHS = 2
ACCUMULATION_STEPS = 4


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
               loader: DataLoader) -> None:
    loss_fn = nn.MSELoss()
    model.train()
    optimizer.zero_grad()
    for epoch in range(EPOCHS):
        for i, (inputs, targets) in enumerate(loader):
            outputs = model(inputs)
            loss = loss_fn(outputs, targets) / ACCUMULATION_STEPS
            loss.backward()
            if (i + 1) % ACCUMULATION_STEPS == 0:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        print(f"epoch {epoch}: last micro-batch loss {loss.item() * ACCUMULATION_STEPS:.4f}")


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: LambdaLR, loader: DataLoader) -> None:
    loss_fn = nn.MSELoss()
    model.train()
    with salus.connect(name="accumulate", iterations=EPOCHS * len(loader),
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer, scheduler=scheduler)

        @remote.iteration
        def forward_backward(s, inputs, targets):
            outputs = s.model(inputs)
            loss = loss_fn(outputs, targets) / ACCUMULATION_STEPS
            loss.backward()
            return loss

        @remote.function
        def step(s):
            nn.utils.clip_grad_norm_(s.model.parameters(), 1.0)
            s.optimizer.step()
            s.scheduler.step()
            s.optimizer.zero_grad()

        remote.call(lambda s: s.optimizer.zero_grad())
        for epoch in range(EPOCHS):
            for i, (inputs, targets) in enumerate(loader):
                loss = forward_backward(inputs, targets)
                if (i + 1) % ACCUMULATION_STEPS == 0:
                    step()
            print(f"epoch {epoch}: last micro-batch loss {loss.item() * ACCUMULATION_STEPS:.4f}")
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(5)
    torch.set_num_threads(1)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    inputs = torch.randn(512, 16)
    with torch.no_grad():
        targets = teacher(inputs) + 0.05 * torch.randn(512, 4)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 8))
    if address is None:
        run_direct(model, optimizer, scheduler, loader)
    else:
        run_salus(address, model, optimizer, scheduler, loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
