"""The synthetic(alpha, beta) federated task of FedProx (Li et al., MLSys 2020, §5.1).

Written from the paper's description, following its reference code (litian96/FedProx,
``data/synthetic_1_1/generate_synthetic.py``) where the text leaves a choice open:

- device k labels its samples with its own multinomial logistic regression,
  ``y = argmax(softmax(W_k x + b_k))``, ``x`` in R^60, ``W_k`` in R^{10x60}, ``b_k`` in R^10;
- every entry of ``W_k`` and ``b_k`` is drawn from N(u_k, 1), ``u_k ~ N(0, alpha)``: alpha sets
  how much the devices' models differ;
- ``x_k ~ N(v_k, Sigma)``, ``Sigma`` diagonal with ``Sigma_jj = j^-1.2``; every entry of ``v_k``
  is drawn from N(B_k, 1), ``B_k ~ N(0, beta)``: beta sets how much the devices' inputs differ;
- sample counts follow a power law; like the reference code, they are
  ``floor(lognormal(mean=4, sigma=2)) + 50`` per device (heavy-tailed, at least 50);
- each device's samples are shuffled and split 90 % training, 10 % test.

The reference code draws ``N(0, alpha)`` and ``N(0, beta)`` with alpha and beta as standard
deviations; so does this module (the paper's notation leaves variance or deviation open; the
two agree for synthetic(1, 1)). All draws come from one seeded ``numpy.random.Generator``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .data import ClientDataset

FEATURES = 60
CLASSES = 10
TRAIN_FRACTION = 0.9
MIN_SAMPLES = 50


def synthetic(
    alpha: float, beta: float, *, devices: int = 30, seed: int = 0
) -> list[ClientDataset]:
    """One `ClientDataset` per device of synthetic(alpha, beta); the same seed gives equal data."""
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta are standard deviations, got {alpha}, {beta}")
    if devices < 1:
        raise ValueError(f"need at least one device, got {devices}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4.0, 2.0, devices).astype(np.int64) + MIN_SAMPLES
    model_means = rng.normal(0.0, alpha, devices)
    input_centres = rng.normal(0.0, beta, devices)
    input_means = rng.normal(input_centres[:, None], 1.0, (devices, FEATURES))
    input_stds = np.arange(1, FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt(j^-1.2)
    clients = []
    for k in range(devices):
        weights = rng.normal(model_means[k], 1.0, (FEATURES, CLASSES))
        bias = rng.normal(model_means[k], 1.0, CLASSES)
        x = input_means[k] + input_stds * rng.standard_normal((int(sizes[k]), FEATURES))
        y = np.argmax(x @ weights + bias, axis=1)  # softmax is monotone: argmax of the logits
        order = rng.permutation(int(sizes[k]))
        split = int(TRAIN_FRACTION * sizes[k])
        xt = torch.from_numpy(x[order]).float()
        yt = torch.from_numpy(y[order]).long()
        clients.append(ClientDataset(xt[:split], yt[:split], xt[split:], yt[split:]))
    return clients


def synthetic_model() -> nn.Module:
    """The paper's model for synthetic data: multinomial logistic regression (60 -> 10 logits)."""
    return nn.Linear(FEATURES, CLASSES)
