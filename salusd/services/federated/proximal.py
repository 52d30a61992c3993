"""The FedProx proximal term ``mu/2 * ||w - w_t||^2`` added to every local objective.

Local training adds the term's gradient ``mu * (w - w_t)`` to each parameter's gradient in
closed form, as the paper's reference optimizer (``PerturbedGradientDescent``) does, instead of
differentiating the term through autograd at every step: same update, about half the cost per
step on a small model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


@torch.no_grad()
def add_proximal_gradient_(params: Sequence[Tensor], anchor: Sequence[Tensor], mu: float) -> None:
    """Add ``mu * (w - w_t)`` to each ``w.grad`` in place (``w`` in `params`, ``w_t`` in `anchor`).

    A parameter without a gradient gets the proximal gradient alone.
    """
    for w, w_t in zip(params, anchor, strict=True):
        if w.grad is None:
            w.grad = mu * (w - w_t)
        else:
            w.grad.add_(w - w_t, alpha=mu)
