"""bench/fedprox.py end to end at two rounds: one JSON object on stdout, the plot on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_prints_one_json_object_and_writes_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "fig1.png"
    proc = subprocess.run(
        [sys.executable, "bench/fedprox.py", "--rounds", "2", "--plot", str(plot)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    losses = out["train_loss_per_round"]
    assert set(losses) == {"0%", "50%", "90%"}
    assert all(len(v) == 3 for by in losses.values() for v in by.values())
    ratio = losses["90%"]["FedAvg"][-1] / losses["90%"]["FedProx (mu=1)"][-1]
    assert abs(out["final_loss_ratio_fedavg_vs_fedprox_90pct"] - ratio) < 1e-3
    assert plot.stat().st_size > 0
