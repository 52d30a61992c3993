"""MNIST-style CNN with Adadelta and StepLR, after pytorch/examples `mnist/main.py`.

Synthetic 16x16 "digits" from a seed stand in for MNIST; the loop is the example's: train with
dropout over a shuffling loader, test under `no_grad`, `scheduler.step()` once per epoch.
Run: `python mnist_steplr.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "CNN with dropout, Adadelta, StepLR stepped per epoch, shuffling loader, test pass"
SALUS_LINES_CHANGED = 20
EPOCHS = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_digits(n: int, prototypes: torch.Tensor) -> TensorDataset:
    labels = torch.randint(0, 10, (n,))
    images = prototypes[labels] + 0.8 * torch.randn(n, 1, 16, 16)
    return TensorDataset(images, labels)


def run_direct(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: StepLR,
               train_loader: DataLoader, test_loader: DataLoader) -> None:
    for epoch in range(1, EPOCHS + 1):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
        model.eval()
        test_loss = 0.0
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
        print(f"epoch {epoch}: test loss {test_loss / len(test_loader.dataset):.4f}, "
              f"accuracy {correct}/{len(test_loader.dataset)}, loss {loss.item():.4f}")
        scheduler.step()


def run_salus(address: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: StepLR, train_loader: DataLoader, test_loader: DataLoader) -> None:
    with salus.connect(name="mnist", iterations=EPOCHS * len(train_loader),
                       address=address) as job:
        remote = job.attach(model=model, optimizer=optimizer, scheduler=scheduler)

        @remote.iteration
        def train(s, data, target):
            s.model.train()
            s.optimizer.zero_grad()
            output = s.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            s.optimizer.step()
            return loss

        @remote.function
        def test(s, data, target):
            s.model.eval()
            with torch.no_grad():
                output = s.model(data)
                return (F.nll_loss(output, target, reduction="sum").item(),
                        output.argmax(dim=1).eq(target).sum().item())

        for epoch in range(1, EPOCHS + 1):
            for data, target in train_loader:
                loss = train(data, target)
            test_loss = 0.0
            correct = 0
            for data, target in test_loader:
                batch_loss, batch_correct = test(data, target)
                test_loss += batch_loss
                correct += batch_correct
            print(f"epoch {epoch}: test loss {test_loss / len(test_loader.dataset):.4f}, "
                  f"accuracy {correct}/{len(test_loader.dataset)}, loss {loss.item():.4f}")
            remote.call(lambda s: s.scheduler.step())
        remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(1)
    torch.set_num_threads(1)
    prototypes = torch.randn(10, 1, 16, 16)
    train_loader = DataLoader(synthetic_digits(512, prototypes), batch_size=64, shuffle=True)
    test_loader = DataLoader(synthetic_digits(256, prototypes), batch_size=128)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    if address is None:
        run_direct(model, optimizer, scheduler, train_loader, test_loader)
    else:
        run_salus(address, model, optimizer, scheduler, train_loader, test_loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
