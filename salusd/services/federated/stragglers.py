"""System heterogeneity as in the FedProx paper (§5.1): a share of each round's clients are
stragglers that can finish only a random number of local epochs in [1, E)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def epoch_budgets(
    selected: Sequence[int], epochs: int, straggler_share: float, rng: np.random.Generator
) -> dict[int, int]:
    """Work budget of each selected client this round, in epochs it can finish.

    As in the reference code, ``round(K * (1 - straggler_share))`` of the K clients, chosen
    uniformly, finish all `epochs`; each of the others gets a budget drawn uniformly from
    ``[1, epochs)``.
    """
    if not 0.0 <= straggler_share <= 1.0:
        raise ValueError(f"straggler_share is a fraction in [0, 1], got {straggler_share}")
    stragglers_wanted = len(selected) - round(len(selected) * (1.0 - straggler_share))
    if stragglers_wanted and epochs < 2:
        raise ValueError(f"stragglers run fewer than E epochs, so E must be >= 2, got {epochs}")
    stragglers = set(rng.choice(list(selected), size=stragglers_wanted, replace=False).tolist())
    return {c: int(rng.integers(1, epochs)) if c in stragglers else epochs for c in selected}
