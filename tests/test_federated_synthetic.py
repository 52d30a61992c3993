"""synthetic(alpha, beta): shapes, classes, heavy-tailed sample counts, input covariance, seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from salus.daemon.services.federated import synthetic, synthetic_model
from salus.daemon.services.federated.synthetic import CLASSES, FEATURES

torch.set_num_threads(1)


def test_shapes_dtypes_and_the_90_10_split() -> None:
    clients = synthetic(1.0, 1.0, seed=0)
    assert len(clients) == 30
    for c in clients:
        total = c.num_train + c.y_test.shape[0]
        assert total >= 50
        assert c.num_train == int(0.9 * total)
        assert c.x_train.shape == (c.num_train, 60) and c.x_test.shape[1] == 60
        assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64
    assert synthetic_model()(clients[0].x_train).shape == (clients[0].num_train, 10)


def test_ten_classes_over_all_devices() -> None:
    labels = torch.cat([torch.cat([c.y_train, c.y_test]) for c in synthetic(1.0, 1.0, seed=0)])
    assert int(labels.min()) >= 0 and int(labels.max()) < CLASSES
    assert set(labels.tolist()) == set(range(CLASSES))


def test_sample_counts_are_heavy_tailed() -> None:
    clients = synthetic(1.0, 1.0, devices=400, seed=1)
    sizes = np.array([c.num_train + c.y_test.shape[0] for c in clients])
    assert sizes.min() >= 50
    # sizes - 50 are floored lognormal(4, 2) draws: log-median ~4, log-IQR ~2 * 1.349
    logs = np.log(np.maximum(sizes - 50, 1))
    assert abs(np.median(logs) - 4.0) < 0.4
    q1, q3 = np.percentile(logs, [25, 75])
    assert abs((q3 - q1) - 2.0 * 1.349) < 0.6
    top_tenth = np.sort(sizes)[-len(sizes) // 10 :]
    assert top_tenth.sum() > 0.4 * sizes.sum()


def test_feature_variances_follow_j_to_the_minus_1_2() -> None:
    largest = max(synthetic(1.0, 1.0, seed=0), key=lambda c: c.num_train)
    x = torch.cat([largest.x_train, largest.x_test]).double()
    assert x.shape[0] > 500
    expected = torch.arange(1, FEATURES + 1, dtype=torch.float64) ** -1.2
    ratio = x.var(dim=0) / expected
    assert float((ratio - 1).abs().max()) < 0.25


def test_the_same_seed_gives_the_same_data_and_another_seed_other_data() -> None:
    a, b, c = synthetic(1.0, 1.0, seed=3), synthetic(1.0, 1.0, seed=3), synthetic(1.0, 1.0, seed=4)
    assert all(torch.equal(p.x_train, q.x_train) and torch.equal(p.y_test, q.y_test)
               for p, q in zip(a, b, strict=True))
    assert [p.num_train for p in a] != [q.num_train for q in c]


def test_negative_alpha_is_refused() -> None:
    with pytest.raises(ValueError, match="standard deviations"):
        synthetic(-1.0, 1.0)
