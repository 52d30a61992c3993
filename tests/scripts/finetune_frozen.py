"""Fine-tune a new head on a frozen, pretrained backbone kept in eval mode.

As in the transfer-learning tutorial's "ConvNet as fixed feature extractor": the backbone's
parameters get `requires_grad = False`, only the head is given to the optimizer, and each epoch
sets `model.train()` then `model.backbone.eval()` so that its BatchNorm running statistics do
not drift. Through salusd `job.train_step` follows those train/eval switches of the client's
model. The saved "pretrained_backbone" lets the test check the statistics did not move.
Run: `python finetune_frozen.py ADDRESS|- OUT.pt` (`-` trains directly, without salusd).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.adapters.torch as salus

PATTERN = "frozen pretrained backbone in eval mode (BatchNorm stats fixed), train only a new head"
SALUS_LINES_CHANGED = 6
EPOCHS = 3


class Classifier(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def pretrained_backbone() -> nn.Module:
    """A stand-in for loading pretrained weights: BatchNorm statistics from other data."""
    model = Classifier(num_classes=100)
    model.train()
    with torch.no_grad():
        for _ in range(5):
            model(2 + 3 * torch.randn(32, 3, 12, 12))
    return model.backbone


def run_direct(model: Classifier, optimizer: torch.optim.Optimizer, loader: DataLoader) -> None:
    criterion = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        model.train()
        model.backbone.eval()
        running_loss = 0.0
        for inputs, labels in loader:
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")


def run_salus(address: str, model: Classifier, optimizer: torch.optim.Optimizer,
              loader: DataLoader) -> None:
    criterion = nn.CrossEntropyLoss()
    with salus.connect(name="finetune", iterations=EPOCHS * len(loader), address=address) as job:
        step = job.train_step(model, optimizer, criterion)
        for epoch in range(EPOCHS):
            model.train()
            model.backbone.eval()
            running_loss = 0.0
            for inputs, labels in loader:
                loss = step(inputs, labels)
                running_loss += loss
            print(f"epoch {epoch}: loss {running_loss / len(loader):.4f}")
        job.remote.pull()


def main(address: str | None, out_path: str) -> None:
    torch.manual_seed(6)
    torch.set_num_threads(1)
    model = Classifier(num_classes=4)
    model.backbone = pretrained_backbone()
    pretrained = copy.deepcopy(model.backbone.state_dict())
    for param in model.backbone.parameters():
        param.requires_grad = False
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
    labels = torch.randint(0, 4, (256,))
    images = torch.randn(256, 3, 12, 12) + labels.view(-1, 1, 1, 1) * 0.5
    loader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True)
    if address is None:
        run_direct(model, optimizer, loader)
    else:
        run_salus(address, model, optimizer, loader)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "pretrained_backbone": pretrained}, out_path)


if __name__ == "__main__":
    main(None if sys.argv[1] == "-" else sys.argv[1], sys.argv[2])
