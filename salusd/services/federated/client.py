"""Local training on one client: minibatch SGD on cross-entropy plus the proximal term."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import ClientDataset
from .proximal import add_proximal_gradient_
from .task import ClientTask, ClientUpdate


def train_client(task: ClientTask, dataset: ClientDataset) -> ClientUpdate:
    """Run `task.epochs` epochs of SGD from the global weights on `dataset`'s training samples.

    The local objective is ``h_k(w) = F_k(w) + mu/2 * ||w - w_t||^2`` with ``F_k`` the mean
    cross-entropy of a minibatch and ``w_t`` the global weights; each epoch visits the samples in
    a fresh random order in minibatches of `task.batch_size` (the last one may be smaller), and
    each minibatch takes one step ``w -= lr * grad h_k(w)``. Everything random (order, dropout)
    comes from `task.seed`, without touching the caller's random state, so equal tasks give
    equal updates. Module-level, so it can be shipped to another process by reference.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(task.seed)
        model = task.model_fn()
        model.load_state_dict(task.global_state)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        anchor = [p.detach().clone() for p in params]
        for _ in range(task.epochs):
            for batch in torch.randperm(dataset.num_train).split(task.batch_size):
                loss = F.cross_entropy(model(dataset.x_train[batch]), dataset.y_train[batch])
                for p in params:
                    p.grad = None
                loss.backward()
                if task.mu > 0:
                    add_proximal_gradient_(params, anchor, task.mu)
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-task.lr)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return ClientUpdate(task.client_id, state, dataset.num_train, task.epochs)
