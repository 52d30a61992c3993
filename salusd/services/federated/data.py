"""`ClientDataset`: one simulated device's local data, split into training and test samples."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class ClientDataset:
    """A device's samples: features ``(samples, features)`` float32, class labels int64.

    Plain tensors, so a dataset pickles as is and can be shipped to the process that trains on it.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    def __post_init__(self) -> None:
        if self.x_train.shape[0] != self.y_train.shape[0]:
            raise ValueError("x_train and y_train need one label per sample")
        if self.x_test.shape[0] != self.y_test.shape[0]:
            raise ValueError("x_test and y_test need one label per sample")

    @property
    def num_train(self) -> int:
        """Training samples on this device (the weight n_k of its update)."""
        return int(self.y_train.shape[0])
