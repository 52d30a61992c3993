"""Mixed precision on the CPU: forward and loss under `torch.autocast("cpu", torch.bfloat16)`.

The recipe of the PyTorch automatic-mixed-precision docs for CPU: the forward pass and the loss
run under autocast (matmuls and convolutions in bfloat16), the backward pass and the optimizer
step outside it; bfloat16 needs no GradScaler. Evaluation also runs under autocast.
Run: `python bf16_autocast.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "bf16 autocast on CPU for forward + loss, backward and SGD step in float32"
SALUS_LINES_CHANGED = 16
EPOCHS = 3


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(4, 16, 5, padding=2), nn.ReLU(),
        nn.Conv1d(16, 16, 5, padding=2), nn.ReLU(),
        nn.AdaptiveMaxPool1d(1), nn.Flatten(),
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5),
    )


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, train_loader: DataLoader,
               val_inputs: torch.Tensor, val_labels: torch.Tensor) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        model.train()
        for inputs, labels in train_loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = model(inputs)
                loss = loss_fn(outputs, labels)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            val_logits = model(val_inputs)
        accuracy = (val_logits.argmax(1) == val_labels).float().mean().item()
        print(f"epoch {epoch}: loss {loss.item():.4f} ({loss.dtype}), val accuracy {accuracy:.3f}")


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              train_loader: DataLoader, val_inputs: torch.Tensor,
              val_labels: torch.Tensor) -> None:
    loss_fn = nn.CrossEntropyLoss()
    with salus.connect(name="bf16", iterations=EPOCHS * len(train_loader),
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer)

        @remote.iteration
        def train(s, inputs, labels):
            s.model.train()
            s.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs = s.model(inputs)
                loss = loss_fn(outputs, labels)
            loss.backward()
            s.optimizer.step()
            return loss

        @remote.function
        def validate(s, inputs):
            s.model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                return s.model(inputs)

        for epoch in range(EPOCHS):
            for inputs, labels in train_loader:
                loss = train(inputs, labels)
            val_logits = validate(val_inputs)
            accuracy = (val_logits.argmax(1) == val_labels).float().mean().item()
            print(f"epoch {epoch}: loss {loss.item():.4f} ({loss.dtype}), "
                  f"val accuracy {accuracy:.3f}")
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(8)
    torch.set_num_threads(1)
    patterns = torch.randn(5, 4, 32)
    labels = torch.randint(0, 5, (448,))
    signals = patterns[labels] + 0.7 * torch.randn(448, 4, 32)
    train_loader = DataLoader(TensorDataset(signals[:384], labels[:384]), batch_size=32,
                              shuffle=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    if address is None:
        run_direct(model, optimizer, train_loader, signals[384:], labels[384:])
    else:
        run_salus(address, model, optimizer, train_loader, signals[384:], labels[384:])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
