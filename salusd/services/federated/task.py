"""What the server sends a client for one round (`ClientTask`) and what comes back (`ClientUpdate`).

Both are plain picklable values, so a runner may train a client in this process, in a worker
process, or as a function of a job in the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ClientTask:
    """One client's local work for a round.

    `global_state` is the global model's ``state_dict`` (CPU tensors); `model_fn` builds an
    untrained model of the same architecture and must pickle (a module-level function or a
    ``functools.partial`` of one; cloudpickle also takes closures). `epochs` are full passes over
    the client's training samples, `mu` the proximal coefficient (0: plain local SGD), `lr` the
    SGD step size per minibatch, `batch_size` samples per minibatch, `seed` the seed of the
    client's shuffling and of any randomness in the model.
    """

    client_id: int
    global_state: dict[str, Tensor]
    model_fn: Callable[[], nn.Module]
    epochs: int
    mu: float
    lr: float
    batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"a client task runs at least one epoch, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.mu < 0:
            raise ValueError(f"mu must be non-negative, got {self.mu}")


@dataclass(frozen=True)
class ClientUpdate:
    """A client's local model after its task: ``state_dict`` (CPU tensors), training samples
    n_k (the aggregation weight) and the epochs it ran."""

    client_id: int
    state: dict[str, Tensor]
    num_samples: int
    epochs: int
