"""Global metrics of a model over all clients, as the paper reports them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .data import ClientDataset


@torch.no_grad()
def evaluate(model: nn.Module, clients: Sequence[ClientDataset]) -> tuple[float, float]:
    """``(training loss, test accuracy)`` of `model` over every client's samples.

    The training loss is the mean cross-entropy (nats per sample) over the union of the clients'
    training samples, i.e. the n_k-weighted mean of the clients' losses, the objective f(w) the
    paper plots; the test accuracy is the fraction of all test samples classified correctly.
    """
    was_training = model.training
    model.eval()
    loss_sum, train_samples, correct, test_samples = 0.0, 0, 0, 0
    for client in clients:
        loss_sum += float(F.cross_entropy(model(client.x_train), client.y_train, reduction="sum"))
        train_samples += client.num_train
        correct += int((model(client.x_test).argmax(dim=1) == client.y_test).sum())
        test_samples += int(client.y_test.shape[0])
    model.train(was_training)
    return loss_sum / train_samples, correct / max(test_samples, 1)
